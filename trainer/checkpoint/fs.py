"""File operations on a local path or on a URL with a protocol (``memory://``, ``s3://``, ...), as
Lightning's loggers write through fsspec: a URL goes to its fsspec filesystem (fsspec must be
installed for it), a plain path to ``os``. Used by the CSV logger and ``hparams.yaml``."""
from __future__ import annotations

import os
from typing import IO, Any


def is_url(path: "str | os.PathLike") -> bool:
    return "://" in os.fspath(path)


def _fs(path: "str | os.PathLike") -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{os.fspath(path)!r}: writing logs to a URL needs fsspec (pip install fsspec)") from None
    return fsspec.core.url_to_fs(os.fspath(path))[0]


def isdir(path: "str | os.PathLike") -> bool:
    return _fs(path).isdir(os.fspath(path)) if is_url(path) else os.path.isdir(path)


def isfile(path: "str | os.PathLike") -> bool:
    return _fs(path).isfile(os.fspath(path)) if is_url(path) else os.path.isfile(path)


def listdir(path: "str | os.PathLike") -> list[str]:
    if is_url(path):
        return [os.path.basename(p.rstrip("/")) for p in _fs(path).ls(os.fspath(path), detail=False)]
    return os.listdir(path)


def makedirs(path: "str | os.PathLike") -> None:
    if is_url(path):
        _fs(path).makedirs(os.fspath(path), exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def remove(path: "str | os.PathLike") -> None:
    if is_url(path):
        _fs(path).rm(os.fspath(path))
    else:
        os.remove(path)


def open_file(path: "str | os.PathLike", mode: str = "r", **kwargs: Any) -> IO:
    if is_url(path):
        return _fs(path).open(os.fspath(path), mode, **kwargs)
    return open(path, mode, **kwargs)
