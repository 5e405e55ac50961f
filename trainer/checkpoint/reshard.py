"""The strategy-neutral view of a checkpoint: parameter shards by canonical name.

Saving: each rank's :meth:`Strategy.param_shards` (for every parameter it holds, a flat element
range of the full parameter with the fp32 weights and per-element optimizer state over that
range, plus 0-dim optimizer state) becomes the tensors of its shard file (:func:`shard_entries`),
and rank 0 merges every rank's ranges into the layout in ``meta.pt`` (:func:`layout_meta`).

Loading on any world size and strategy: :class:`CheckpointReader` serves any element range of
any saved tensor, reading only the bytes of the files that hold it, and each strategy's
:meth:`Strategy.load_param_shards` asks it for exactly the ranges this rank needs. Before that,
:func:`check_compatible` names every missing, unexpected and shape-mismatched parameter and an
optimizer of another type, and :func:`resume_position` maps the data position onto the new world
size (see its docstring for what happens when the global batch changes).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from ...strategies import progress
from ...strategies.base import ParamShard
from . import single_file as checkpoint_file
from .directory import META, rank_file
from ..errors import CheckpointError
from .tensor_files import Entry, SafetensorsFile, dtype_name

T = TypeVar("T")
_SHOW = 12  # names listed per kind of mismatch


# ---------------------------------------------------------------------------- collectives

def all_gather(strategy: Any, obj: Any) -> list[Any]:
    if not strategy.distributed:
        return [obj]
    out = [None] * strategy.world_size
    progress.mark("all_gather_object")
    dist.all_gather_object(out, obj)
    return out


def agree(strategy: Any, fn: Callable[[], T], catch: tuple[type[Exception], ...] = (CheckpointError,)) -> T:
    """Collective: run ``fn`` on every rank; if it raised one of ``catch`` on any rank, raise the
    first such error as CheckpointError on every rank (so no rank is left waiting in a later
    collective)."""
    result, error = None, None
    try:
        result = fn()
    except catch as exc:
        error = str(exc)
    first = next((e for e in all_gather(strategy, error) if e), None)
    if first is not None:
        raise CheckpointError(first)
    return result


# ---------------------------------------------------------------------------- saving

def shard_entries(shards: Mapping[str, ParamShard], extras: Mapping[str, torch.Tensor]
                  ) -> tuple[list[Entry], dict[str, Any]]:
    """The tensors of one rank's shard file, and the layout description it sends to rank 0."""
    entries: list[Entry] = []
    ranges, kinds, scalars = {}, {}, {}
    for name, sh in shards.items():
        n = sh.end - sh.start
        for kind, t in sh.tensors.items():
            if t.numel() != n:
                raise ValueError(f"param_shards(): {kind} of {name!r} has {t.numel()} elements for the "
                                 f"range [{sh.start}, {sh.end})")
            entries.append(Entry(f"{kind}/{name}", torch.float32, (n,), lambda t=t: t.reshape(-1).float()))
        for kind, t in sh.scalars.items():
            entries.append(Entry(f"scalar/{kind}/{name}", t.dtype, (), lambda t=t: t.reshape(())))
        ranges[name], kinds[name], scalars[name] = [sh.start, sh.end], sorted(sh.tensors), sorted(sh.scalars)
    for name, t in extras.items():
        entries.append(Entry.of(f"extra/{name}", t))
    return entries, {"ranges": ranges, "kinds": kinds, "scalars": scalars, "extras": sorted(extras)}


def model_info_meta(info: Mapping[str, Any]) -> dict[str, Any]:
    """``Strategy.checkpoint_model_info()`` in plain types (lists and dtype names)."""
    return {"params": {n: [list(s), dtype_name(d)] for n, (s, d) in info["params"].items()},
            "extras": {n: [list(s), dtype_name(d)] for n, (s, d) in info["extras"].items()},
            "aliases": dict(info["aliases"]), "keys": list(info["keys"])}


def merge_model_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The union over ranks (pipeline stages each know their own layers)."""
    out: dict[str, Any] = {"params": {}, "extras": {}, "aliases": {}, "keys": []}
    seen: set[str] = set()
    for info in infos:
        for key in ("params", "extras", "aliases"):
            for n, v in info[key].items():
                out[key].setdefault(n, v)
        out["keys"] += [k for k in info["keys"] if k not in seen]
        seen.update(info["keys"])
    return out


def layout_meta(locals_: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: every rank's ranges and model description -> the layout part of ``meta.pt``.
    Checks that the ranks' ranges cover every parameter (a strategy bug otherwise)."""
    model = merge_model_info([loc["model"] for loc in locals_])
    params = {n: {"shape": shape, "dtype": dtype, "ranges": [], "kinds": [], "scalars": []}
              for n, (shape, dtype) in model["params"].items()}
    for rank, loc in enumerate(locals_):
        for n, (start, end) in loc["ranges"].items():
            if n not in params:
                raise ValueError(f"rank {rank} saved {n!r}, which no rank's model names")
            p = params[n]
            p["ranges"].append([rank, start, end])
            p["kinds"] = sorted(set(p["kinds"]) | set(loc["kinds"][n]))
            p["scalars"] = sorted(set(p["scalars"]) | set(loc["scalars"][n]))
    for n, p in params.items():
        covered = 0
        for _, start, end in sorted(p["ranges"], key=lambda r: r[1]):
            covered = max(covered, end) if start <= covered else covered
        if covered < math.prod(p["shape"]):
            raise ValueError(f"the ranks' shards cover {covered} of the {math.prod(p['shape'])} elements of {n!r}")
    extras = {}
    for rank, loc in enumerate(locals_):
        for n in loc["extras"]:
            shape, dtype = model["extras"][n]
            extras.setdefault(n, {"shape": shape, "dtype": dtype, "rank": rank})
    return {"params": params, "extras": extras, "aliases": model["aliases"], "keys": model["keys"]}


def optimizer_meta(optimizer: torch.optim.Optimizer, group_names: list[list[str]]) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "param_groups": groups, "names": group_names}


def merge_group_names(per_rank: list[list[list[str]]]) -> list[list[str]]:
    """Union of each param group's names over ranks, first-seen order."""
    out: list[list[str]] = []
    for groups in per_rank:
        for g, names in enumerate(groups):
            while len(out) <= g:
                out.append([])
            out[g] += [n for n in names if n not in out[g]]
    return out


# ---------------------------------------------------------------------------- checking

def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def check_compatible(root: Path, meta: Mapping[str, Any], model: Mapping[str, Any],
                     optimizer: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming every difference between the checkpoint and this run's
    model (``merge_model_info`` of all ranks) and optimizer (type, union of group names)."""
    problems = []
    for what, saved, want in (("parameters", meta["params"], model["params"]),
                              ("buffers and frozen parameters", meta["extras"], model["extras"])):
        missing = sorted(set(want) - set(saved))
        unexpected = sorted(set(saved) - set(want))
        shapes = [f"{n} (checkpoint {list(saved[n]['shape'])}, model {list(want[n][0])})"
                  for n in sorted(set(want) & set(saved)) if list(saved[n]["shape"]) != list(want[n][0])]
        if missing:
            problems.append(f"missing {what} (in the model, not in the checkpoint): {_listed(missing)}")
        if unexpected:
            problems.append(f"unexpected {what} (in the checkpoint, not in the model): {_listed(unexpected)}")
        if shapes:
            problems.append(f"shape mismatch: {_listed(shapes)}")
    if problems:
        raise CheckpointError(f"checkpoint {str(root)!r} was saved from a different model:\n  "
                              + "\n  ".join(problems))
    saved_opt = meta["optimizer"]
    if saved_opt["type"] != optimizer["type"]:
        raise CheckpointError(f"checkpoint {str(root)!r} was saved with optimizer {saved_opt['type']}; this "
                              f"run uses {optimizer['type']}. Its state cannot be loaded into another "
                              "optimizer type: configure the same optimizer")
    saved_groups, groups = saved_opt["names"], optimizer["names"]
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"checkpoint {str(root)!r} has {len(saved_groups)} optimizer param groups; this "
                              f"run has {len(groups)}")
    for g, (a, b) in enumerate(zip(saved_groups, groups)):
        if set(a) != set(b):
            moved = sorted(set(a) ^ set(b))
            raise CheckpointError(f"optimizer param group {g} holds other parameters than in checkpoint "
                                  f"{str(root)!r}: {_listed(moved)}")


# ---------------------------------------------------------------------------- reading

#: the most per-element tensors one parameter may have saved ("param" and its optimizer states)
MAX_KINDS = 64


class CheckpointReader:
    """Any element range of any saved tensor, read from the shard files that hold it (positioned
    reads of those bytes only); implements ``strategies.base.ShardReader``."""

    def __init__(self, root: str | Path, meta: Mapping[str, Any]) -> None:
        self.root, self.meta = Path(root), meta
        self._files: dict[int, Any] = {}
        is_file = meta.get("format") == checkpoint_file.FORMAT  # one .ckpt file, already read
        self._flat = checkpoint_file.tensors(self.root, dict(meta)) if is_file else None
        self._kinds: dict[str, list[str]] = {}

    def _file(self, rank: int) -> SafetensorsFile:
        if rank not in self._files:
            self._files[rank] = (SafetensorsFile(self.root / rank_file(rank)) if self._flat is None
                                 else checkpoint_file.TensorFile(self.root, self._flat))
        return self._files[rank]

    def _param(self, name: str) -> Mapping[str, Any]:
        try:
            return self.meta["params"][name]
        except KeyError:
            raise CheckpointError(f"checkpoint {str(self.root)!r} has no parameter {name!r}") from None

    def names(self) -> list[str]:
        return list(self.meta["params"])

    def kinds(self, name: str) -> list[str]:
        """The per-element kinds ``meta.pt`` lists for ``name``, checked before a loader sizes a
        buffer per kind: at most MAX_KINDS of them, each held (at least its range's elements) by
        the file of the parameter's first non-empty range. (Each read checks its own file.)"""
        if name not in self._kinds:
            info = self._param(name)
            kinds = list(info["kinds"])
            if len(kinds) > MAX_KINDS:
                raise CheckpointError(f"checkpoint {str(self.root)!r}: {META} lists {len(kinds)} per-element "
                                      f"kinds for {name!r} (at most {MAX_KINDS}: optimizer states)")
            for rank, s, e in [r for r in info["ranges"] if r[2] > r[1]][:1]:
                f = self._file(rank)
                for kind in kinds:
                    key = f"{kind}/{name}"
                    held = math.prod(f.info(key)[1]) if key in f else 0
                    if held < e - s:
                        raise CheckpointError(f"checkpoint file {f.path!r} holds {held} elements of {key!r}; "
                                              f"{META} places elements [{s}, {e}) of {name!r} there")
            self._kinds[name] = kinds
        return list(self._kinds[name])

    def read(self, name: str, kind: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        info = self._param(name)
        numel = math.prod(info["shape"])
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"range [{start}, {end}) is outside {name!r} ({numel} elements)")
        key, pieces, pos = f"{kind}/{name}", [], start
        for rank, s, e in sorted(info["ranges"], key=lambda r: r[1]):
            if pos >= end:
                break
            if s <= pos < e:
                stop = min(e, end)
                pieces.append((rank, s, pos, stop))
                pos = stop
        if pos < end:
            raise CheckpointError(f"checkpoint {str(self.root)!r} holds no {kind} for elements "
                                  f"[{pos}, {end}) of {name!r}")
        for rank, s, lo, hi in pieces:  # each piece inside its file's header before anything is allocated
            f = self._file(rank)
            held = math.prod(f.info(key)[1])
            if hi - s > held:
                raise CheckpointError(f"checkpoint file {f.path!r} holds {held} elements of {key!r}; "
                                      f"{META} places elements [{s}, {hi}) of {name!r} there")
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32)
        for rank, s, lo, hi in pieces:
            self._file(rank).read(key, lo - s, hi - s, out=out[lo - start:hi - start])
        return out

    def scalars(self, name: str) -> dict[str, torch.Tensor]:
        info = self._param(name)
        if not info["ranges"] or not info["scalars"]:
            return {}
        f = self._file(info["ranges"][0][0])
        return {k: f.read(f"scalar/{k}/{name}") for k in info["scalars"]}

    def extra(self, name: str) -> torch.Tensor:
        try:
            rank = self.meta["extras"][name]["rank"]
        except KeyError:
            raise CheckpointError(f"checkpoint {str(self.root)!r} has no buffer {name!r}") from None
        return self._file(rank).read(f"extra/{name}")

    def param_groups(self, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
        saved = self.meta["optimizer"]["param_groups"]
        return [{**cur, **{k: v for k, v in s.items() if k not in ("params", "names")}}
                for cur, s in zip(current, saved)]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- the data position

def resume_position(loop: dict[str, int], saved: Mapping[str, Any] | None, batch_size: int | None,
                    world: int) -> tuple[dict[str, int], str | None]:
    """Map the loop counters onto a new data-parallel world size; returns them and a note to log.

    The position kept is the *global sample position* in the epoch: ``batches_in_epoch`` (per-rank
    micro-batches) x per-rank batch x world. With the same global batch (per-rank batch x world,
    e.g. 4 x 6 -> 2 x 12) every later global batch holds exactly the samples it would have held
    (the DistributedSampler's order is a function of seed and epoch; rank r takes every W-th
    index, so global batch b is positions [b*G, (b+1)*G) for any W). If the global batch changes,
    the run resumes at the last position that is a whole number of new global batches (a partial
    batch's samples are seen again) and the optimizer steps from then on see differently sized
    batches. Only the epoch's last, padded batch can differ between world sizes whose
    DistributedSampler pads the dataset differently. ``global_step`` and ``epoch`` are kept. After
    a fit that ``max_steps`` cut mid-epoch (``cut_batches``: that epoch ended, yet a later fit
    continues it) the position is the cut one's; if it rounds down to no batch, that epoch starts over."""
    if not saved or (saved.get("world") == world and saved.get("batch_size") == batch_size):
        return loop, None
    old_bs, old_world = saved.get("batch_size"), saved.get("world")
    if old_bs is None or batch_size is None:
        return loop, (f"data-parallel world size {old_world} -> {world} with a loader of unknown batch size: "
                      f"each rank resumes at its micro-batch {loop.get('batches_in_epoch', 0)} of the epoch")
    old_global, new_global = old_bs * old_world, batch_size * world
    cut = bool(loop.get("cut_batches", 0))
    key, epoch = ("cut_batches", loop.get("epoch", 0) - 1) if cut else ("batches_in_epoch", loop.get("epoch", 0))
    samples = loop.get(key, 0) * old_global
    batches, rest = divmod(samples, new_global)
    out = dict(loop, total_batches=loop.get("total_batches", 0) * old_global // new_global, **{key: batches})
    if cut and not batches:  # no whole new batch of the cut epoch was trained: it starts over
        out["epoch"] = epoch
    note = (f"data-parallel layout {old_world} x {old_bs} -> {world} x {batch_size} (global batch "
            f"{old_global} -> {new_global}); resuming at sample {batches * new_global} of epoch {epoch}")
    if rest:
        note += f" ({rest} samples before it are seen again: {samples} is not a multiple of {new_global})"
    return out, note
