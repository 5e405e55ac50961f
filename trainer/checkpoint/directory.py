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
``latest`` (temporary file, fsync, rename). A process killed at any moment leaves ``latest``
naming a complete checkpoint: the previous one, or the new one (``NAME.old`` stands in for
``NAME`` between its two renames). Shards are safetensors, ``meta.pt`` is read with
``weights_only=True``: a checkpoint can never run code, and every number in it is checked against
the files before anything is sized by it (:func:`check_meta`). A failed save removes its
``NAME.partial`` on every rank; a later save removes the ones a killed job left.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from . import single_file as checkpoint_file
from ..errors import CheckpointError
from ..api.hparams import loads_safely
from .tensor_files import Entry, FileDigest, SafetensorsFile, file_digest, fsync_dir, write_safetensors

META = "meta.pt"
LATEST = "latest"
FORMAT = "zerotrain.sharded/1"
#: the largest world size a checkpoint may claim (loading sizes per-rank work by it)
MAX_WORLD_SIZE = 1 << 20
#: the largest ``meta.pt`` a load reads (every rank reads it whole)
MAX_META_BYTES = 2 << 30
#: the largest ``latest`` pointer file (it holds one checkpoint name)
MAX_LATEST_BYTES = 4096


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


def _why(exc: BaseException) -> str:
    """The OS's reason for an OSError (``No space left on device``), else the error itself."""
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else None) or str(exc) or repr(exc)


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


def _load_error(exc: BaseException) -> str:
    """torch.load's error, without its advice to load with weights_only=False (which would run
    whatever the file holds): the refused global, when that is the reason."""
    text = str(exc)
    _, found, why = text.partition("WeightsUnpickler error:")
    if found:
        return "it holds a value a safe load refuses: " + why.strip().split(". ")[0]
    refused = [line for line in text.splitlines() if "unsupported GLOBAL" in line or "Unsupported global" in line]
    if "Weights only load failed" in text and refused:  # torch >= 2.6's wording
        return "it holds a value a safe load refuses: " + refused[0].strip().split(". ")[0]
    return text


def check_archive(file: Path, max_bytes: int | None = MAX_META_BYTES, crc: bool = True) -> None:
    """A torch.save file, before torch reads it: at most ``max_bytes``, every record stored
    uncompressed (torch never compresses, and a compressed record could unpack to any size in
    memory) and, with ``crc``, matching its CRC-32 (torch's reader does not check them, so a
    flipped byte would load). A file that is not a zip archive (torch's legacy format) is left
    to torch.load."""
    try:
        size = file.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise CheckpointError(f"checkpoint file {str(file)!r} is {size} bytes, over the {max_bytes} a "
                                  f"{file.name} may have")
        if not zipfile.is_zipfile(file):
            return
        with zipfile.ZipFile(file) as archive:
            packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
            if packed:
                raise CheckpointError(f"checkpoint file {str(file)!r} has compressed records ({_short(packed)}); "
                                      "torch.save stores them uncompressed: not a file torch wrote")
            broken = archive.testzip() if crc else None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {_why(exc)}") from None
    if broken is not None:
        raise CheckpointError(f"checkpoint file {str(file)!r} is damaged: record {broken!r} does not match its "
                              "CRC-32")


# ---------------------------------------------------------------------------- bounds of meta.pt

def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _strs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def check_meta(root: Path, meta: dict[str, Any]) -> None:
    """Check every number ``meta.pt`` states before anything is sized by it, so that a corrupt or
    hostile one fails here, naming the file, instead of allocating what it claims:

    * ``world_size`` in 1..MAX_WORLD_SIZE, at most that many shard files listed, each with an
      integer size and a sha256 (:func:`verify` then compares the listing and sizes with the files);
    * every parameter's and buffer's shape (non-negative integers) and dtype (a torch dtype name);
      every range ``[rank, start, end]`` on a rank of the job and inside its parameter; the ranges
      of each parameter cover it;
    * the bytes the layout places in each shard file (at least 4 per element of its ranges, 1 per
      element of its buffers) fit in the size recorded for that file: no parameter is larger than
      the files that hold it (and the reader checks each range against its file's own header,
      which must match the file's real size, before it allocates anything);
    * the layout's other parts have the types loading uses (names, aliases, RNG states).

    The layout parts are optional (a metadata file without them has nothing to load)."""
    file = root / META

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {str(file)!r} is corrupt: {why}")

    ws = meta.get("world_size")
    if not _count(ws) or not 1 <= ws <= MAX_WORLD_SIZE:
        raise bad(f"world_size={_short(ws)} (valid: an integer in 1..{MAX_WORLD_SIZE})")
    files = meta.get("files")
    if not isinstance(files, dict) or len(files) > ws:
        raise bad(f"it lists {len(files) if isinstance(files, dict) else _short(files)} shard files for "
                  f"world_size={ws}")
    for name, info in files.items():
        if not (isinstance(name, str) and isinstance(info, dict) and _count(info.get("size"))
                and isinstance(info.get("sha256"), str)):
            raise bad(f"shard file entry {_short(name)}: {_short(info)}")
    placed: dict[int, int] = {}  # bytes of tensors the layout puts in each rank's file

    def place(rank: Any, nbytes: int, what: str) -> None:
        if not _count(rank) or rank >= ws:
            raise bad(f"{what} is saved by rank {_short(rank)}, outside world_size={ws}")
        placed[rank] = placed.get(rank, 0) + nbytes

    def shape_of(x: Any, what: str) -> tuple[int, ...]:
        if not isinstance(x, (list, tuple)) or len(x) > 64 or not all(_count(d) for d in x):
            raise bad(f"{what} has shape {_short(x)} (valid: a list of integers >= 0)")
        return tuple(x)

    def dtype_of(x: Any, what: str) -> torch.dtype:
        dtype = getattr(torch, x, None) if isinstance(x, str) else None
        if not isinstance(dtype, torch.dtype):
            raise bad(f"{what} has dtype {_short(x)}")
        return dtype

    params, extras = meta.get("params", {}), meta.get("extras", {})
    if not isinstance(params, dict) or not isinstance(extras, dict):
        raise bad("its params/extras are not mappings")
    def entry(kind: str, name: Any, x: Any) -> tuple[str, int]:
        """``(description, element count)`` of one described tensor, its shape and dtype checked."""
        what = f"{kind} {_short(name)}"
        if not isinstance(name, str) or not isinstance(x, dict):
            raise bad(f"{what}: {_short(x)}")
        numel = math.prod(shape_of(x.get("shape"), what))
        dtype_of(x.get("dtype"), what)
        return what, numel

    for name, p in params.items():
        what, numel = entry("parameter", name, p)
        kinds, ranges = p.get("kinds"), p.get("ranges")
        if not _strs(kinds) or not _strs(p.get("scalars")) or not isinstance(ranges, list):
            raise bad(f"{what}: kinds {_short(kinds)}, scalars {_short(p.get('scalars'))}, ranges {_short(ranges)}")
        for r in ranges:
            if not (isinstance(r, (list, tuple)) and len(r) == 3 and all(_count(x) for x in r)):
                raise bad(f"{what}: range {_short(r)} (valid: [rank, start, end], integers >= 0)")
            rank, start, end = r
            if not start <= end <= numel:
                raise bad(f"{what}: range [{start}, {end}) is outside its {numel} elements")
            place(rank, (end - start) * 4, what)  # its fp32 "param" elements at least
        covered = 0
        for _, start, end in sorted(ranges, key=lambda r: r[1]):
            covered = max(covered, end) if start <= covered else covered
        if covered < numel:
            raise bad(f"the ranges of {what} cover {covered} of its {numel} elements")
    for name, x in extras.items():
        what, numel = entry("buffer", name, x)
        place(x.get("rank"), numel, what)  # a byte per element at least, whatever dtype the rank saved
    for rank, nbytes in sorted(placed.items()):
        name = rank_file(rank)
        if name not in files:
            raise bad(f"its layout places tensors in {name}, which it does not list")
        if nbytes > files[name]["size"]:
            raise bad(f"its layout places {nbytes} bytes of tensors in {name}, recorded as {files[name]['size']} "
                      "bytes long")
    aliases, keys = meta.get("aliases", {}), meta.get("keys", [])
    if not (isinstance(aliases, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
            and _strs(keys)):
        raise bad("its state-dict keys or aliases are not strings")
    rng = meta.get("rng", [])
    if not isinstance(rng, list) or len(rng) > ws or not all(
            isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) and r["torch"].dtype == torch.uint8
            and isinstance(r.get("python"), (list, tuple)) and len(r["python"]) == 3 for r in rng):
        raise bad(f"its RNG states are not {ws} saved generator states")
    if "params" in meta:  # a Trainer's checkpoint: what resuming and consolidating read besides the layout
        missing = [k for k in _TRAINER_KEYS if k not in meta]
        if missing:
            raise bad(f"it has a layout but no {', '.join(missing)}")
    loop, opt, data = meta.get("loop", {}), meta.get("optimizer", {}), meta.get("data")
    if not isinstance(loop, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                             for k, v in loop.items()):
        raise bad(f"loop={_short(loop)} (valid: named counters)")
    names, groups = (opt.get("names", []), opt.get("param_groups", [])) if isinstance(opt, dict) else (None, None)
    if not (isinstance(opt, dict) and isinstance(opt.get("type", ""), str) and isinstance(names, list)
            and all(_strs(g) for g in names) and isinstance(groups, list)
            and all(isinstance(g, dict) for g in groups)):
        raise bad(f"optimizer={_short(opt)}")
    if data is not None and not (isinstance(data, dict) and all(data.get(k) is None or _count(data[k])
                                                                for k in ("batch_size", "world"))):
        raise bad(f"data={_short(data)}")
    if not all(isinstance(meta.get(k, ""), str) for k in ("strategy", "precision")):
        raise bad(f"strategy={_short(meta.get('strategy'))}, precision={_short(meta.get('precision'))}")


#: what a checkpoint with a layout (a Trainer's) must hold: resuming and consolidating read these
_TRAINER_KEYS = ("extras", "aliases", "keys", "loop", "strategy", "precision", "precision_state", "optimizer",
                 "rng")


def verify(root: Path, meta: dict[str, Any], ranks: Sequence[int] | None = None) -> None:
    """Check that every shard file exists with its recorded size, and the sha256 of the files of
    ``ranks`` (default: all). Raises CheckpointError naming the first bad file."""
    check_meta(root, meta)  # bounded world size and listing before anything is sized by them
    if meta.get("format") == checkpoint_file.FORMAT:  # one .ckpt file: its CRC-32s were checked by
        return  # load_meta, its tensors against the layout by the reader
    files, world = meta["files"], meta["world_size"]
    if len(files) != world:
        missing = next((rank_file(r) for r in range(world) if rank_file(r) not in files), None)
        raise CheckpointError(f"{str(root / META)!r} lists no {missing}")
    checksum = None if ranks is None else set(ranks)
    for r in range(world):
        name = rank_file(r)
        file = root / name
        want = files.get(name)
        if want is None:
            raise CheckpointError(f"{str(root / META)!r} lists no {name}")
        try:
            if not file.is_file():
                raise CheckpointError(f"checkpoint {str(root)!r} has no {name}")
            size = file.stat().st_size
            if size != want["size"]:
                raise CheckpointError(f"checkpoint file {str(file)!r} is truncated or corrupt: {size} bytes, "
                                      f"{META} recorded {want['size']}")
            if checksum is None or r in checksum:
                if file_digest(file).sha256 != want["sha256"]:
                    raise CheckpointError(f"checkpoint file {str(file)!r} is corrupt: its sha256 does not "
                                          f"match the one {META} recorded")
                SafetensorsFile(file).close()  # and its header parses
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {_why(exc)}") from None
