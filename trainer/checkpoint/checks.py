"""Checking a checkpoint before anything trusts it: the files a checkpoint directory holds
(``meta.pt``, one ``rank_NNNNN.safetensors`` per rank) and the bounds they are held to.
:func:`check_archive` reads a torch.save file's zip records (size cap, stored uncompressed, CRC-32)
before torch does; :func:`check_meta` bounds every number ``meta.pt`` states before anything is
sized by it; :func:`verify` compares the shard files with what ``meta.pt`` recorded (size, sha256,
a parsable header). ``directory.py`` writes and finds checkpoints and re-exports these names.
"""
from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from . import single_file as checkpoint_file
from ..errors import CheckpointError
from .tensor_files import SafetensorsFile, file_digest

META = "meta.pt"
#: the largest world size a checkpoint may claim (loading sizes per-rank work by it)
MAX_WORLD_SIZE = 1 << 20
#: the largest ``meta.pt`` a load reads (every rank reads it whole)
MAX_META_BYTES = 2 << 30


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _why(exc: BaseException) -> str:
    """The OS's reason for an OSError (``No space left on device``), else the error itself."""
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else None) or str(exc) or repr(exc)


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
