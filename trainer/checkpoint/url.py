"""Checkpoints given by URL (``http://`` / ``https://``), as Lightning reads them (through
``torch.hub``): ``load_from_checkpoint(url)``, ``load_checkpoint(url)`` (Lightning's
``cloud_io._load``) and ``Trainer.fit/validate/test/predict(ckpt_path=url)``.

The file is downloaded to a fresh local temporary folder (never a shared cache under a name
someone else may reuse) and then read exactly as a local checkpoint file is: weights-only, with
its archive checks. ``read_checkpoint`` deletes its copy once the tensors are in memory; a
Trainer's ``ckpt_path`` copy stays until the process ends, since the restore reads it later."""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from ..errors import CheckpointError

_SCHEMES = ("http://", "https://")
_TIMEOUT_S = 60  # per blocking read, as a stalled server should not hang a job forever
_CHUNK = 1 << 20


def is_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith(_SCHEMES)


def _name(url: str) -> str:
    name = os.path.basename(urlparse(url).path)
    return name or "checkpoint.ckpt"


def download(url: str, folder: str | os.PathLike) -> Path:
    """``url`` saved into ``folder`` under its own file name; a CheckpointError naming the URL when
    it cannot be fetched."""
    target = Path(folder) / _name(url)
    try:  # what torch.hub's download does, without its progress bar
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response, open(target, "wb") as out:
            shutil.copyfileobj(response, out, _CHUNK)
    except Exception as exc:  # noqa: BLE001 - HTTP errors, refused connections, timeouts
        raise CheckpointError(f"cannot download checkpoint {url!r}: {exc}") from exc
    return target


@contextlib.contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """A downloaded copy of ``url`` that lives for the ``with`` block."""
    with tempfile.TemporaryDirectory(prefix="zerotrain-url-ckpt-") as folder:
        yield download(url, folder)


def kept_copy(url: str) -> str:
    """A downloaded copy of ``url`` that lives until the process exits."""
    folder = tempfile.mkdtemp(prefix="zerotrain-url-ckpt-")
    atexit.register(shutil.rmtree, folder, True)
    return str(download(url, folder))
