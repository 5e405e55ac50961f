"""Checkpoint directories: one shard file per rank, one metadata file, written atomically.

Layout of a checkpoint ``DIR/NAME/`` (``NAME`` is e.g. ``step=000100``)::

    rank_00000.safetensors   what rank 0 alone holds: for each parameter (canonical name) the flat
    rank_00001.safetensors   element range it holds, as ``param/NAME`` (fp32 weights) and
    ...                      ``exp_avg/NAME``, ``exp_avg_sq/NAME``... (per-element optimizer state
                             over the same range), ``scalar/step/NAME`` (0-dim optimizer state) and,
                             in the files of the ranks that save them, ``extra/NAME`` (buffers,
                             frozen parameters). Every rank writes a file, possibly empty.
    meta.pt                  written by rank 0 last: step, epoch, data position, every rank's RNG
                             state, scheduler, loss scaler, callbacks, world size, strategy,
                             optimizer type and hyperparameters, the layout (for every parameter
                             its shape, dtype and which rank holds which range), and the size and
                             sha256 of every shard file

and beside it ``DIR/latest``, a small file naming the newest complete checkpoint.

Saving (collective): rank 0 makes ``NAME.partial/``; every rank writes its shard file there,
computing its sha256 while writing, and fsyncs it; the ranks' layouts, RNG states and digests are
gathered to rank 0, which writes ``meta.pt``, fsyncs, renames ``NAME.partial`` to ``NAME`` (a
previous ``NAME`` is moved to ``NAME.old`` first and deleted after), and only then rewrites
``latest`` (temporary file, fsync, rename). A process killed at any moment leaves ``latest``
naming a complete checkpoint: the previous one, or the new one (``NAME.old`` stands in for
``NAME`` between its two renames). Shards are safetensors, ``meta.pt`` is read with
``weights_only=True``: a checkpoint can never run code.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .errors import CheckpointError
from .tensor_files import Entry, FileDigest, SafetensorsFile, file_digest, fsync_dir, write_safetensors

META = "meta.pt"
LATEST = "latest"
FORMAT = "zerotrain.sharded/1"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


# ---------------------------------------------------------------------------- collectives

class Comm(NamedTuple):
    """The three collectives a save needs, as plain functions (one process: trivial ones)."""

    rank: int
    world_size: int
    barrier: Callable[[], None]
    gather: Callable[[Any], list | None]  # to rank 0; None elsewhere
    broadcast: Callable[[Any], Any]  # from rank 0


def comm_of(strategy: Any) -> Comm:
    def gather(obj: Any) -> list | None:
        if not strategy.distributed:
            return [obj]
        out = [None] * strategy.world_size if strategy.is_global_zero else None
        dist.gather_object(obj, out, dst=0)
        return out

    return Comm(strategy.global_rank, strategy.world_size, strategy.barrier, gather, strategy.broadcast)


# ---------------------------------------------------------------------------- RNG

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


# ---------------------------------------------------------------------------- small atomic files

def _fsync_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_latest(directory: str | os.PathLike, name: str) -> None:
    """Point ``directory/latest`` at checkpoint ``name`` (temporary file, fsync, rename, fsync)."""
    directory = Path(directory)
    tmp = directory / (LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    fsync_dir(directory)


def read_latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``directory/latest`` names, or None when there is no pointer."""
    pointer = Path(directory) / LATEST
    try:
        name = pointer.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not name or "/" in name or name in (".", ".."):
        raise CheckpointError(f"{str(pointer)!r} does not name a checkpoint (it holds {name!r})")
    return Path(directory) / name


def _publish(partial: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- save

def save(path: str | os.PathLike, comm: Comm, entries: Sequence[Entry], local: dict[str, Any],
         meta: Callable[[list[dict[str, Any]]], dict[str, Any]], update_latest: bool = True) -> Path:
    """Collective: write this rank's ``entries`` and publish the checkpoint (module docstring).

    ``local`` is this rank's description (its layout, RNG state); rank 0 calls ``meta(locals)``
    with every rank's, each completed with its file's ``"file": {"size", "sha256"}``. A failure on
    any rank raises CheckpointError on every rank and leaves the previous checkpoint in place."""
    final = Path(path).absolute()
    partial = final.with_name(final.name + ".partial")
    if comm.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    comm.barrier()
    error = None
    try:
        digest = _write_shard(partial / rank_file(comm.rank), entries, comm.rank)
        local = {**local, "file": {"size": digest.size, "sha256": digest.sha256}}
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error = f"rank {comm.rank} could not write {partial / rank_file(comm.rank)}: {exc!r}"
    gathered = comm.gather({"local": local, "error": error})
    status = None
    if comm.rank == 0:
        errors = [g["error"] for g in gathered if g["error"]]
        if not errors:
            try:
                locals_ = [g["local"] for g in gathered]
                files = {rank_file(r): loc["file"] for r, loc in enumerate(locals_)}
                _fsync_save({**meta(locals_), "format": FORMAT, "world_size": comm.world_size,
                             "files": files}, partial / META)
                fsync_dir(partial)
                _publish(partial, final)
                if update_latest:
                    write_latest(final.parent, final.name)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"rank 0 could not publish {final}: {exc!r}")
        status = errors[0] if errors else None
    status = comm.broadcast(status)
    if status:
        raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {status}")
    return final


def _write_shard(file: Path, entries: Sequence[Entry], rank: int) -> FileDigest:
    """One rank's shard file (a separate function: the kill tests interrupt it)."""
    return write_safetensors(file, entries, {"format": FORMAT, "rank": str(rank)})


# ---------------------------------------------------------------------------- find and check

def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` means: a checkpoint itself, a directory holding a
    ``latest`` pointer (or that pointer file), ``NAME`` while only ``NAME.old`` exists (a save
    killed between its renames), or ``DIR/last`` (earlier releases' name) when ``DIR/latest``
    exists."""
    p = Path(path)
    if p.name == LATEST and p.is_file():
        return resolve(read_latest(p.parent))
    if (p / META).is_file():
        return p
    if (p / LATEST).is_file():
        return resolve(read_latest(p))
    old = p.with_name(p.name + ".old")
    if (old / META).is_file():
        return old
    if p.name == "last" and (p.parent / LATEST).is_file():
        return resolve(read_latest(p.parent))
    raise CheckpointError(f"no checkpoint at {str(p)!r} (expected a directory holding {META}, or a "
                          f"directory with a {LATEST!r} pointer)")


def load_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    root = resolve(path)
    file = root / META
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle payloads, truncation, wrong format
        raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format", "none (an earlier zerotrain layout)") if isinstance(meta, dict) else type(meta)
        raise CheckpointError(f"{str(file)!r} has format {found}; this zerotrain reads {FORMAT!r}")
    return root, meta


def verify(root: Path, meta: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
    """Check that every shard file exists with its recorded size, and the sha256 of the files of
    ``ranks`` (default: all). Raises CheckpointError naming the first bad file."""
    files = meta["files"]
    checksum = set(range(meta["world_size"]) if ranks is None else ranks)
    for r in range(meta["world_size"]):
        name = rank_file(r)
        file = root / name
        want = files.get(name)
        if want is None:
            raise CheckpointError(f"{str(root / META)!r} lists no {name}")
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(root)!r} has no {name}")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is truncated or corrupt: {size} bytes, "
                                  f"{META} recorded {want['size']}")
        if r in checksum:
            if file_digest(file).sha256 != want["sha256"]:
                raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt: its sha256 does not "
                                      f"match the one {META} recorded")
            SafetensorsFile(file).close()  # and its header parses
