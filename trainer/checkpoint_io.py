"""Checkpoint directories: one file per rank, one metadata file, written atomically.

Layout of ``PATH/``::

    meta.pt          written by rank 0 last: counters, scheduler, callbacks, world size, strategy,
                     and the size + sha256 of every rank file
    rank_00000.pt    each rank's RNG states and, if the strategy says this rank holds unique state
    rank_00001.pt    (``writes_shard``), its shard: model/optimizer state it alone keeps

Every rank writes into ``PATH.partial/``; after a barrier rank 0 writes ``meta.pt`` there, moves
any previous ``PATH`` aside, renames ``PATH.partial`` to ``PATH`` and deletes the old one. A
process killed at any moment leaves either the old or the new checkpoint complete (a reader falls
back to ``PATH.old`` if it finds that alone). Everything is read with ``weights_only=True``: a
checkpoint can never run code.
"""
from __future__ import annotations

import hashlib
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import CheckpointError

META = "meta.pt"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _fsync_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def save(path: str | os.PathLike, *, rank: int, world_size: int, shard: dict | None,
         meta: Callable[[], dict], barrier: Callable[[], None]) -> None:
    """Collective: every rank calls it. ``meta`` is only evaluated on rank 0."""
    final = Path(path)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier()
    _fsync_save({"rng": rng_state(), "shard": shard}, partial / rank_file(rank))
    barrier()
    if rank == 0:
        files = {rank_file(r): {"size": (partial / rank_file(r)).stat().st_size,
                                "sha256": _digest(partial / rank_file(r))} for r in range(world_size)}
        _fsync_save({**meta(), "world_size": world_size, "files": files}, partial / META)
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if (p / META).exists():
        return p
    old = p.with_name(p.name + ".old")
    if (old / META).exists():  # killed between the two renames of a save
        return old
    raise CheckpointError(f"no checkpoint at {str(p)!r} (expected a directory holding {META})")


def _load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle payloads, truncation, wrong format
        raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {exc}") from exc


def load_meta(path: str | os.PathLike) -> tuple[Path, dict]:
    p = resolve(path)
    return p, _load(p / META)


def load_rank(path: Path, meta: dict, rank: int, verify: bool = True) -> dict:
    name = rank_file(rank)
    file = path / name
    if not file.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {name}")
    expected = meta["files"].get(name)
    if verify and expected is not None:
        if file.stat().st_size != expected["size"] or _digest(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt or truncated "
                                  "(its checksum does not match meta.pt)")
    return _load(file)
