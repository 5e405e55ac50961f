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

and beside it ``DIR/latest``, a small file naming the newest complete checkpoint. (A save of
unsharded state to ``NAME.ckpt`` is one Lightning-style file instead: ``checkpoint_file.py``.)

Saving (collective): rank 0 makes ``NAME.partial/``; every rank writes its shard file there,
computing its sha256 while writing, and fsyncs it; the ranks' layouts, RNG states and digests are
gathered to rank 0, which writes ``meta.pt``, fsyncs, renames ``NAME.partial`` to ``NAME`` (a
previous ``NAME`` is moved to ``NAME.old`` first and deleted after), and only then rewrites
``latest`` (temporary file, fsync, rename). A process killed at any moment leaves ``latest`` naming
a complete checkpoint: the previous one, or the new one (``NAME.old`` stands in for ``NAME`` between
its two renames). Shards are safetensors, ``meta.pt`` is read with ``weights_only=True``: a
checkpoint can never run code, and every number in it is checked against the files before anything
is sized by it (``checks.py``: :func:`check_meta`, :func:`verify`). A failed save removes its
``NAME.partial`` on every rank; a later save removes the ones a killed job left.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from . import single_file as checkpoint_file
from ..errors import CheckpointError
from ..api.hparams import loads_safely
from .checks import (  # noqa: F401  (re-exported: the checks were defined here)
    MAX_META_BYTES, MAX_WORLD_SIZE, META, _load_error, _why, check_archive, check_meta, rank_file, verify,
)
from .tensor_files import Entry, FileDigest, file_digest, fsync_dir, write_safetensors

LATEST = "latest"
FORMAT = "zerotrain.sharded/1"
#: the largest ``latest`` pointer file (it holds one checkpoint name)
MAX_LATEST_BYTES = 4096


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
    if "cuda" in state and torch.cuda.is_available():  # saved per visible device; this run may see fewer
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


# ---------------------------------------------------------------------------- small atomic files

def _unloadable(obj: Any, where: str = "") -> str:
    """The deepest key path under ``obj`` whose value ``torch.load(weights_only=True)`` refuses,
    with its type (``obj`` as a whole when no single part is to blame)."""
    parts = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in parts:
        if not loads_safely(value):
            return _unloadable(value, f"{where}[{key!r}]")
    return f"{where or 'the whole'} ({type(obj).__module__}.{type(obj).__qualname__})"


def _fsync_save(obj: Any, path: Path) -> None:
    buf = io.BytesIO()  # small (no tensors but RNG states); written by plain I/O, a full disk is an OSError
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # a load checks them (check_archive), whatever the user chose
    try:
        torch.save(obj, buf)
    finally:
        torch.serialization.set_crc32_options(crc)
    try:  # a value that only full unpickling could read would make the checkpoint unloadable
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - named below
        raise ValueError(f"{path.name} would hold a value a safe load refuses: {_unloadable(obj)}. Store plain "
                         "Python values (numbers, strings, lists, dicts) or tensors there, e.g. float(x) for a "
                         "numpy scalar, str(p) for a path") from None
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(buf.getbuffer())
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
        with pointer.open("rb") as f:
            raw = f.read(MAX_LATEST_BYTES + 1)
        name = raw.decode().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {str(pointer)!r}: {_why(exc)}") from None
    if len(raw) > MAX_LATEST_BYTES:
        raise CheckpointError(f"{str(pointer)!r} is over {MAX_LATEST_BYTES} bytes: not a pointer zerotrain wrote")
    if not name or "/" in name or name in (".", "..", LATEST):
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
    any rank raises CheckpointError on every rank, naming the file and the OS's reason, removes
    the new ``NAME.partial`` (every rank its file, then rank 0 the folder) and leaves the previous
    checkpoint in place. Rank 0 first removes stale ``*.partial`` checkpoint folders beside it (a
    killed job's)."""
    final = Path(path).absolute()
    if checkpoint_file.wants_file(final) and checkpoint_file.unsharded(comm, len(entries)):
        def pointer() -> None:  # Lightning's folder holds checkpoints only: a pointer only where one is
            if update_latest and (final.parent / LATEST).exists():  # (a sharded save's), kept true
                write_latest(final.parent, final.name)

        return checkpoint_file.save(final, comm, entries, local, meta, _unloadable, pointer)
    partial = final.with_name(final.name + ".partial")
    mine = partial / rank_file(comm.rank)
    error = None
    if comm.rank == 0:
        try:
            remove_stale_partials(final.parent)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as exc:  # a read-only or full disk: reported on every rank below
            error = f"rank 0: creating {exc.filename or partial}: {_why(exc)}"
    comm.barrier()
    if error is None:
        try:
            digest = _write_shard(mine, entries, comm.rank)
            local = {**local, "file": {"size": digest.size, "sha256": digest.sha256}}
        except OSError as exc:
            error = f"rank {comm.rank}: writing {mine}: {_why(exc)}"
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"rank {comm.rank} could not write {mine}: {exc!r}"
    gathered = comm.gather({"local": local, "error": error})
    status = None
    if comm.rank == 0:
        errors = [g["error"] for g in gathered if g["error"]]
        if not errors:
            doing = partial / META
            try:
                locals_ = [g["local"] for g in gathered]
                files = {rank_file(r): loc["file"] for r, loc in enumerate(locals_)}
                _fsync_save({**meta(locals_), "format": FORMAT, "world_size": comm.world_size,
                             "files": files}, partial / META)
                doing = partial
                fsync_dir(partial)
                doing = final
                _publish(partial, final)
                doing = final.parent / LATEST
                if update_latest:
                    write_latest(final.parent, final.name)
            except OSError as exc:
                errors.append(f"rank 0: writing {exc.filename or doing}: {_why(exc)}")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"rank 0 could not publish {final}: {exc!r}")
        status = errors[0] if errors else None
    status = comm.broadcast(status)
    if status:  # every rank got here with the same status: clean up together, then raise
        with contextlib.suppress(OSError):
            mine.unlink(missing_ok=True)
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {status}")
    return final


def remove_stale_partials(directory: Path) -> list[Path]:
    """Remove ``*.partial`` checkpoint folders in ``directory`` (saves killed before publishing;
    rank 0, before a save). Only folders that hold nothing but shard files and ``meta.pt`` (or its
    temporary file) are removed: a folder of anything else is left alone."""
    removed = []
    try:
        candidates = [p for p in directory.iterdir() if p.name.endswith(".partial") and p.is_dir()]
    except OSError:
        return removed
    for p in candidates:
        try:
            names = [c.name for c in p.iterdir()]
        except OSError:
            continue
        if all(n in (META, META + ".tmp") or (n.startswith("rank_") and n.endswith(".safetensors"))
               for n in names):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _write_shard(file: Path, entries: Sequence[Entry], rank: int) -> FileDigest:
    """One rank's shard file (a separate function: the kill tests interrupt it)."""
    return write_safetensors(file, entries, {"format": FORMAT, "rank": str(rank)})


# ---------------------------------------------------------------------------- find and check

def resolve(path: str | os.PathLike, _hops: int = 0) -> Path:
    """The checkpoint directory ``path`` means: a checkpoint itself, a directory holding a
    ``latest`` pointer (or that pointer file), ``NAME`` while only ``NAME.old`` exists (a save
    killed between its renames), or ``DIR/last`` (earlier releases' name) when ``DIR/latest``
    exists."""
    p = Path(path)
    if _hops > 8:
        raise CheckpointError(f"{str(p)!r}: more than 8 {LATEST!r} pointers in a row (a loop?)")
    try:
        if p.name == LATEST and p.is_file():
            return resolve(read_latest(p.parent), _hops + 1)
        if checkpoint_file.is_file_checkpoint(p):
            return p
        if (p / META).is_file():
            return p
        if (p / LATEST).is_file():
            return resolve(read_latest(p), _hops + 1)
        old = p.with_name(p.name + ".old")
        if (old / META).is_file():
            return old
        if p.name == "last" and (p.parent / LATEST).is_file():
            return resolve(read_latest(p.parent), _hops + 1)
        folder = p if p.is_dir() else p.parent if p.name in (LATEST, "last") and not p.exists() else None
        if folder is not None and checkpoint_file.newest(folder) is not None:  # a folder of .ckpt files
            return checkpoint_file.newest(folder)
    except OSError as exc:  # e.g. a directory this user may not read
        raise CheckpointError(f"cannot look for a checkpoint at {str(p)!r}: {_why(exc)}") from None
    raise CheckpointError(f"no checkpoint at {str(p)!r} (expected a .ckpt file, a directory holding {META}, "
                          f"or a directory with a {LATEST!r} pointer)")


def load_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory ``path`` means and its ``meta.pt``, checked by :func:`check_meta`."""
    root = resolve(path)
    if root.is_file():  # one .ckpt file: its own metadata, its tensors bounding the layout
        checkpoint = checkpoint_file.load(root)
        meta = checkpoint_file.check_meta_of(root, checkpoint)
        check_meta(root, meta)
        return root, meta
    file = root / META
    check_archive(file)
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle payloads, truncation, wrong format
        raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {_load_error(exc)}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format", "none (an earlier zerotrain layout)") if isinstance(meta, dict) else type(meta)
        raise CheckpointError(f"{str(file)!r} has format {found}; this zerotrain reads {FORMAT!r}")
    check_meta(root, meta)
    return root, meta
