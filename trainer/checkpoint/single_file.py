"""Single-file checkpoints: a ``NAME.ckpt`` file in Lightning's layout, for unsharded state.

A save to a path ending in ``.ckpt`` whose state only global rank 0 holds (``single``, ``ddp``:
every other rank's shard is empty) writes one ``torch.save`` file, as Lightning's Trainer does,
instead of a sharded directory. Sharded state (``zero2``, ``zero3``, pipelines) stays a directory,
even when named ``*.ckpt``, as Lightning's DeepSpeed strategy does.

The file is Lightning's dict: ``epoch``, ``global_step``, ``pytorch-lightning_version`` (the
zerotrain version that wrote it), ``state_dict`` (every key of the module's state dict, the
trainable parameters in fp32), ``optimizer_states`` (one ``optimizer.state_dict()``: state by
parameter index over the param groups), ``lr_schedulers``, ``callbacks``, ``loops`` (the loop
counters) and ``hyper_parameters``; beside them the keys of a directory's ``meta.pt`` (the layout,
every rank's RNG state, the data position; ``format`` is :data:`FORMAT`), and whatever
``on_save_checkpoint`` added. Resuming reads the parameters and optimizer state from
``state_dict`` / ``optimizer_states`` through the same reader as a directory (:func:`tensors`),
so it reshards to any strategy and world size.

Written by rank 0 to ``NAME.ckpt.tmp`` (fsync), checked to load with ``weights_only=True``, then
renamed over ``NAME.ckpt``: a process killed at any moment leaves the previous file or the new
one. Read with ``weights_only=True`` and ``mmap=True`` after :func:`~.checkpoint_io.check_archive`
(no compressed records, CRC-32s match): a load never runs code, and the layout is checked against
the tensors the file really holds before anything is sized by it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ...strategies.optimizers import split_kind, suffix
from ..errors import CheckpointError
from ..api.hparams import loads_safely
from .tensor_files import Entry, fsync_dir

FORMAT = "zerotrain.file/1"
SUFFIX = ".ckpt"
#: Lightning's keys this module builds from the tensors and the loop's metadata
LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "state_dict", "optimizer_states",
                  "lr_schedulers", "callbacks", "loops")


_FILE_SUFFIXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("zerotrain_file_suffixes",
                                                                                 default=(SUFFIX,))


def wants_file(path: str | os.PathLike) -> bool:
    """A save to ``path`` is a candidate for one file (Lightning's extension, or one that
    :func:`file_suffix` adds)."""
    return str(path).endswith(_FILE_SUFFIXES.get())


@contextlib.contextmanager
def file_suffix(suffix: str) -> Iterator[None]:
    """Saves inside write ``*suffix`` paths as one file too, as ``.ckpt`` ones: a ModelCheckpoint's
    own ``FILE_EXTENSION`` (Lightning writes a file whatever the extension)."""
    token = _FILE_SUFFIXES.set(_FILE_SUFFIXES.get() + (suffix,))
    try:
        yield
    finally:
        _FILE_SUFFIXES.reset(token)


def is_file_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_file() and Path(path).name != "latest"


def unsharded(comm: Any, n_entries: int) -> bool:
    """Collective: whether global rank 0 holds the whole state (every other rank's shard is empty:
    ``single``, ``ddp``), so that the save can be one file."""
    counts = comm.gather(n_entries)
    return bool(comm.broadcast(all(n == 0 for n in counts[1:]) if comm.rank == 0 else None))


def newest(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in ``directory``: the one its ``latest`` pointer names, else (a folder
    of ``.ckpt`` files only, which need no pointer) the most recently written ``*.ckpt`` file
    (links such as ``last.ckpt`` aside), else None."""
    from .directory import _why, read_latest

    latest = read_latest(directory)
    if latest is not None:
        return latest
    try:
        files = [p for p in Path(directory).iterdir() if p.name.endswith(SUFFIX)
                 and not p.is_symlink() and p.is_file()]
        return max(files, key=lambda p: (p.stat().st_mtime_ns, p.name)) if files else None
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot look for a checkpoint in {str(directory)!r}: {_why(exc)}") from None


# ---------------------------------------------------------------------------- save

def _state_places(group_names: list[list[str]]) -> dict[str, list[tuple[int, str]]]:
    """``name -> [(index in the optimizer state, kind suffix)]`` over the concatenated param
    groups: a parameter in several optimizers has one place per optimizer, its state kinds
    suffixed after the first (``strategies/optimizers.py``)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for i, name in enumerate(n for group in group_names for n in group):
        seen = out.setdefault(name, [])
        seen.append((i, suffix(len(seen))))
    return out


def _of(kinds: list[str], wanted: str) -> list[tuple[str, str]]:
    """``(kind, its name without the suffix)`` for the saved kinds that carry suffix ``wanted``."""
    return [(k, base) for k, (base, sfx) in ((k, split_kind(k)) for k in kinds if k != "param") if sfx == wanted]


def lightning_dict(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's flat tensors (``param/NAME``, ``exp_avg/NAME``, ``scalar/step/NAME``,
    ``extra/NAME``) and the checkpoint's metadata -> Lightning's dict (module docstring). The
    state dict's tensors are views of the flat ones: ``torch.save`` stores each storage once."""
    params, aliases = meta.get("params", {}), meta.get("aliases", {})
    state_dict: dict[str, torch.Tensor] = {}
    for key in meta.get("keys", []):
        name = aliases.get(key, key)
        if name in params:
            state_dict[key] = tensors[f"param/{name}"].view(params[name]["shape"])
        elif f"extra/{key}" in tensors:
            state_dict[key] = tensors[f"extra/{key}"]
    opt = meta.get("optimizer", {})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, places in _state_places(opt.get("names", [])).items():
        p = params.get(name)
        if p is None:
            continue
        for i, sfx in places:  # a parameter in several optimizers: each one's state (exp_avg@1)
            per = {base: tensors[f"{k}/{name}"].view(p["shape"]) for k, base in _of(p["kinds"], sfx)}
            per.update({base: tensors[f"scalar/{k}/{name}"] for k, base in _of(p["scalars"], sfx)})
            if per:
                state[i] = per
    groups, pos = [], 0
    for saved, names in zip(opt.get("param_groups", []), opt.get("names", [])):
        groups.append({**saved, "params": list(range(pos, pos + len(names)))})
        pos += len(names)
    loop = meta.get("loop", {})
    scheduler = meta.get("scheduler")
    from ... import __version__

    return {**meta, "format": FORMAT, "epoch": loop.get("epoch", 0), "global_step": loop.get("global_step", 0),
            "pytorch-lightning_version": __version__, "state_dict": state_dict,
            "optimizer_states": [{"state": state, "param_groups": groups}] if opt else [],
            "lr_schedulers": scheduler if isinstance(scheduler, list) else [] if scheduler is None else [scheduler],
            "callbacks": meta.get("callbacks", {}), "loops": {"zerotrain": dict(loop)}}


def write(path: Path, checkpoint: dict[str, Any], unloadable: Callable[[Any], str]) -> None:
    """Rank 0: ``checkpoint`` to ``path`` atomically (temporary file, fsync, safe-load check,
    rename over ``path``, fsync of the folder). A folder of that name (an earlier sharded save)
    is replaced after the rename."""
    if not loads_safely(checkpoint):  # a value only full unpickling could read: the file would be unloadable
        raise ValueError(f"{path.name} would hold a value a safe load refuses: {unloadable(checkpoint)}. Store "
                         "plain Python values (numbers, strings, lists, dicts) or tensors there, e.g. float(x) "
                         "for a numpy scalar, str(p) for a path")
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # a load checks them (check_archive)
    try:
        with open(tmp, "wb") as f:
            out = _Writer(f)
            try:
                torch.save(checkpoint, out)
            except RuntimeError:  # torch's writer reports a failed write without its OS error
                if out.error is not None:
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        torch.serialization.set_crc32_options(crc)
    old = path.with_name(path.name + ".old")
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


class _Writer:
    """The file ``torch.save`` writes to, keeping the OSError of a failed write (a full disk)."""

    def __init__(self, f: Any) -> None:
        self._f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def save(final: Path, comm: Any, entries: Sequence[Entry], local: dict[str, Any],
         meta: Callable[[list[dict[str, Any]]], dict[str, Any]], unloadable: Callable[[Any], str],
         on_done: Callable[[], None]) -> Path:
    """Collective: every rank sends its description; rank 0 writes the file (its entries are the
    whole state) and calls ``on_done`` (the ``latest`` pointer). A failure raises CheckpointError
    on every rank and leaves the previous file in place."""
    from .directory import _why

    gathered = comm.gather(local)
    status = None
    if comm.rank == 0:
        try:
            tensors = {e.key: e.produce().reshape(e.shape) for e in entries}
            full = meta(gathered)
            write(final, lightning_dict(tensors, {**full, "world_size": comm.world_size}), unloadable)
            on_done()
        except OSError as exc:
            status = f"rank 0: writing {exc.filename or final}: {_why(exc)}"
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            status = f"rank 0 could not write {final}: {exc}"
    status = comm.broadcast(status)
    if status:
        raise CheckpointError(f"saving checkpoint {str(final)!r} failed: {status}")
    return final


# ---------------------------------------------------------------------------- load

def load(path: Path) -> dict[str, Any]:
    """The checkpoint dict of a ``.ckpt`` file zerotrain wrote, read safely (module docstring)."""
    from .directory import _load_error, check_archive

    check_archive(path, max_bytes=None, crc=True)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - pickled code, truncation, another format
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: {_load_error(exc)}") from exc
    from .weights_only import refuse_resume

    refuse_resume(checkpoint)  # a weights-only file: Lightning's KeyError
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        found = checkpoint.get("format", "none") if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{str(path)!r} is not a checkpoint zerotrain can resume from (format {found}; this "
                              f"zerotrain reads {FORMAT!r} files and sharded directories). For weights only, use "
                              "load_from_checkpoint")
    return checkpoint


def check_meta_of(path: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's metadata as :func:`~.checkpoint_io.check_meta` checks a directory's, every
    range placed in rank 0's part (this file, whose size bounds them)."""
    return {**checkpoint, "files": {"rank_00000.safetensors": {"size": path.stat().st_size, "sha256": ""}}}


def tensors(path: Path, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Back from Lightning's keys to the flat tensors a reader reads (the inverse of
    :func:`lightning_dict`), each checked against the layout: a missing tensor or one of another
    size is a CheckpointError naming it."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {why}")

    state_dict = checkpoint.get("state_dict")
    opts = checkpoint.get("optimizer_states") or [{}]
    if not isinstance(state_dict, dict) or not isinstance(opts, list) or not isinstance(opts[0], dict):
        raise bad("no state_dict / optimizer_states")
    opt_state = opts[0].get("state", {})
    places = _state_places(checkpoint.get("optimizer", {}).get("names", []))
    out: dict[str, torch.Tensor] = {}

    def put(key: str, t: Any, numel: int | None) -> None:
        if not isinstance(t, torch.Tensor) or (numel is not None and t.numel() != numel):
            got = t.numel() if isinstance(t, torch.Tensor) else type(t).__name__
            raise bad(f"{key!r} holds {got} elements; its layout says {numel}")
        out[key] = t.reshape(-1) if numel is not None else t

    import math

    for name, p in checkpoint.get("params", {}).items():
        numel = math.prod(p["shape"])
        put(f"param/{name}", state_dict.get(name), numel)
        for i, sfx in places.get(name, [(-1, "")]):
            per = opt_state.get(i, {})
            for kind, base in _of(p["kinds"], sfx):
                put(f"{kind}/{name}", per.get(base), numel)
            for kind, base in _of(p["scalars"], sfx):
                put(f"scalar/{kind}/{name}", per.get(base), None)
    for name, x in checkpoint.get("extras", {}).items():  # read whole (CheckpointReader.extra): keep the shape
        put(f"extra/{name}", state_dict.get(name), math.prod(x["shape"]))
        out[f"extra/{name}"] = out[f"extra/{name}"].reshape(x["shape"])
    return out


class TensorFile:
    """Flat tensors held in memory (a ``.ckpt`` file's), with the reading interface of
    :class:`~.tensor_files.SafetensorsFile` that :class:`~.reshard.CheckpointReader` uses."""

    def __init__(self, path: Path, flat: dict[str, torch.Tensor]) -> None:
        self.path, self._flat = str(path), flat

    def __contains__(self, key: str) -> bool:
        return key in self._flat

    def keys(self) -> list[str]:
        return list(self._flat)

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self._get(key)
        return t.dtype, tuple(t.shape)

    def _get(self, key: str) -> torch.Tensor:
        try:
            return self._flat[key]
        except KeyError:
            raise CheckpointError(f"checkpoint file {self.path!r} has no tensor {key!r}") from None

    def read(self, key: str, start: int = 0, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._get(key)
        if start == 0 and end is None and out is None:
            return t.clone()
        flat = t.reshape(-1)
        end = flat.numel() if end is None else end
        if not 0 <= start <= end <= flat.numel():
            raise CheckpointError(f"{self.path!r}: range [{start}, {end}) is outside {key!r} ({flat.numel()} elements)")
        if out is None:
            return flat[start:end].clone()
        out.view(-1).copy_(flat[start:end])
        return out

    def close(self) -> None:
        self._flat = {}
