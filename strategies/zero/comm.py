"""The collectives ZeRO issues, as plain functions that return handles, and the pooled buffers
they move.

Every function takes all its inputs explicitly, launches with ``async_op=True`` and returns a
handle with ``wait()``; the caller files it in the in-flight layer (``inflight.py``), the only
code that waits on it. On one process (no process group) each is completed at once with
single-process semantics, so callers never branch on the world size. All reductions are SUM:
``ReduceOp.AVG`` is unreliable on gloo (pytorch/pytorch#162338); callers divide by the world size.
Each launch is reported to ``strategies/instrument.py`` (a no-op unless a monitor listens).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist

from .. import instrument, progress

SUM = dist.ReduceOp.SUM if dist.is_available() else None

# torch 2.13 renamed the single-tensor collectives; keep working on older releases (>= 2.4)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Handle(Protocol):
    def wait(self) -> object: ...


class Done:
    """The handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True


def world_size(group: object = None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def backend(group: object = None) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group))


def all_reduce_sum(buf: torch.Tensor, group: object = None) -> Handle:
    """Sum ``buf`` over ranks, in place."""
    if world_size(group) == 1:
        return Done()
    progress.mark("all_reduce", group)
    return instrument.issued("all_reduce", dist.all_reduce(buf, op=SUM, group=group, async_op=True), group, buf)


def least_over_ranks(value: int, device: torch.device, group: object = None) -> int:
    """Collective, blocking: the smallest ``value`` over ranks (decisions every rank must share)."""
    if world_size(group) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> Handle:
    """``out`` (n elements) = sum over ranks of ``inp[rank * n:(rank + 1) * n]``."""
    if world_size(group) == 1:
        out.copy_(inp)
        return Done()
    progress.mark("reduce_scatter", group)
    work = _reduce_scatter_single(out, inp, op=SUM, group=group, async_op=True)
    return instrument.issued("reduce_scatter", work, group, inp)


def reduce_to_owner(buf: torch.Tensor, owner: int, group: object = None) -> Handle:
    """Sum ``buf`` over ranks into ``owner``'s ``buf`` (other ranks' ``buf`` becomes undefined)."""
    if world_size(group) == 1:
        return Done()
    progress.mark("reduce", group)
    return instrument.issued("reduce", dist.reduce(buf, dst=owner, op=SUM, group=group, async_op=True), group, buf)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> Handle:
    """``out[r * n:(r + 1) * n]`` = rank r's ``inp`` (n elements)."""
    if world_size(group) == 1:
        out.copy_(inp)
        return Done()
    progress.mark("all_gather", group)
    return instrument.issued("all_gather", _all_gather_single(out, inp, group=group, async_op=True), group, out)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: object = None) -> Handle:
    """Rank r's ``inp`` is cut into ``in_splits`` pieces, piece k goes to rank k; ``out`` is the
    pieces every rank sent here, in rank order (``out_splits`` long)."""
    if world_size(group) == 1:
        out.copy_(inp)
        return Done()
    progress.mark("all_to_all", group)
    work = dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group, async_op=True)
    return instrument.issued("all_to_all", work, group, inp)


def broadcast_from(buf: torch.Tensor, src: int = 0, group: object = None) -> Handle:
    if world_size(group) == 1:
        return Done()
    progress.mark("broadcast", group)
    return instrument.issued("broadcast", dist.broadcast(buf, src=src, group=group, async_op=True), group, buf)


def gather_to(inp: torch.Tensor, outs: Sequence[torch.Tensor] | None, dst: int = 0,
              group: object = None) -> Handle:
    """``outs[r]`` on ``dst`` = rank r's ``inp``; ``outs`` is None on the other ranks."""
    if world_size(group) == 1:
        outs[0].copy_(inp)
        return Done()
    progress.mark("gather", group)
    work = dist.gather(inp, gather_list=list(outs) if outs is not None else None, dst=dst, group=group,
                       async_op=True)
    return instrument.issued("gather", work, group, inp, ranks=world_size(group))


def new_group(ranks: Sequence[int]) -> object:
    """Collective over the default group: a process group of ``ranks`` (None without one)."""
    if world_size() == 1:
        return None
    return dist.new_group(list(ranks))


class BufferPool:
    """Reusable flat buffers of one dtype, so buckets do not pay a fresh allocation (and its page
    faults) each time. ``acquire(n)`` returns an n-element view of a pooled buffer."""

    def __init__(self, buffer_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer_numel, self.dtype, self.device = buffer_numel, dtype, device
        self._free: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []  # every buffer ever made (for memory reports)

    def acquire(self, numel: int) -> torch.Tensor:
        if numel > self.buffer_numel:
            raise ValueError(f"bucket of {numel} elements exceeds the pool buffer_numel {self.buffer_numel}")
        if not self._free:
            self.buffers.append(torch.empty(self.buffer_numel, dtype=self.dtype, device=self.device))
            self._free.append(self.buffers[-1])
        return self._free.pop()[:numel]

    def release(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        self._free.append(base)

    def clear(self) -> None:
        self._free.clear()
        self.buffers.clear()
