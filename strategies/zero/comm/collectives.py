"""The collectives ZeRO issues, as plain functions that return handles, and the pooled buffers
they move.

Every function takes all its inputs explicitly, launches with ``async_op=True`` and returns a
handle with ``wait()``; the caller files it in the in-flight layer (``inflight.py``), the only
code that waits on it. On one process (no process group) each is completed at once with
single-process semantics, so callers never branch on the world size. All reductions are SUM:
``ReduceOp.AVG`` is unreliable on gloo (pytorch/pytorch#162338); callers divide by the world size.
Each launch is reported to ``strategies/instrument.py`` (a no-op unless a monitor listens).

On gloo three collectives travel another way, because gloo's own are slow on a 2-core machine
(``bench/comm_bench.py``, 2 ranks, 4-64 MB buffers: ``all_gather_into_tensor`` took 1.3-3.1x as
long as one broadcast per rank, ``reduce_scatter_tensor`` 2.8-4.5x as long as an all-to-all):
:func:`all_gather_into` is one in-place broadcast per rank, all in flight together, and
:func:`reduce_scatter_sum` (even pieces, ZeRO-3's units) and :func:`reduce_to_owners` (uneven
pieces, ZeRO-1/2's buckets) one ``all_to_all_single`` whose pieces are added, in rank order, when
the handle is waited. All are reported under their own names and message sizes.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from ... import instrument, progress

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


class Joined:
    """Several launched works as one handle; ``then`` (the local part of the collective: adding
    the pieces an all-to-all brought) runs once, on the thread that waits, after all completed."""

    def __init__(self, works: Sequence[Handle], then: Callable[[], None] | None = None) -> None:
        self.works, self._then = list(works), then

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return True

    def get_future(self) -> torch.futures.Future:
        """Completes when every work has (what ``instrument`` times the collective by)."""
        return torch.futures.collect_all([w.get_future() for w in self.works])


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


def reduce_scatter_scratch(numel: int, group: object = None) -> int:
    """Elements of ``scratch`` that :func:`reduce_scatter_sum` needs for an ``inp`` of ``numel``:
    on gloo the other rank's copy of my piece (2 ranks), or every rank's (more)."""
    world = world_size(group)
    if world == 1 or backend(group) != "gloo":
        return 0
    return numel // world if world == 2 else numel


def reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, group: object = None,
                       scratch: torch.Tensor | None = None) -> Handle:
    """``out`` (n elements) = sum over ranks of ``inp[rank * n:(rank + 1) * n]``.

    On gloo the pieces travel as one all-to-all into ``scratch`` (at least
    :func:`reduce_scatter_scratch` elements, allocated when None; it may begin at ``out``'s own
    storage) and are summed in rank order into ``out`` when the handle is waited; ``inp`` must
    stay untouched until then. With 2 ranks each sends only the other's piece."""
    world = world_size(group)
    if world == 1:
        out.copy_(inp)
        return Done()
    progress.mark("reduce_scatter", group)
    if backend(group) != "gloo":
        work = _reduce_scatter_single(out, inp, op=SUM, group=group, async_op=True)
        return instrument.issued("reduce_scatter", work, group, inp)
    if scratch is None:
        scratch = torch.empty(reduce_scatter_scratch(inp.numel(), group), dtype=inp.dtype, device=inp.device)
    return instrument.issued("reduce_scatter", _gloo_sum_pieces(out, inp, [out.numel()] * world, group, scratch),
                             group, inp)


def owners_scratch(sizes: Sequence[int], group: object = None) -> int:
    """Elements of ``scratch`` that :func:`reduce_to_owners` needs for pieces of ``sizes``: on gloo
    the other rank's copy of my piece (2 ranks), or every rank's (more)."""
    world = world_size(group)
    if world == 1 or backend(group) != "gloo":
        return 0
    mine = sizes[dist.get_rank(group)]
    return mine if world == 2 else world * mine


def reduce_to_owners(buf: torch.Tensor, sizes: Sequence[int], group: object = None,
                     out: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> Handle:
    """A reduce-scatter with uneven pieces: ``buf`` is cut into rank r's piece of ``sizes[r]``
    elements, in rank order; once waited, this rank's piece summed over ranks is in ``out``
    (default: my piece of ``buf``); the rest of ``buf`` is left as it was.

    On gloo one all-to-all carries each piece to its owner only (with 2 ranks each sends just
    the other's piece: a message wholly in one partition goes one way, half the bytes an
    all-reduce moves), into ``scratch`` (:func:`owners_scratch` elements; with 2 ranks it may
    begin at ``out``), summed in rank order when waited. Elsewhere one ``reduce`` per owner."""
    world = world_size(group)
    me = dist.get_rank(group) if world > 1 else 0
    bounds = _bounds(sizes)
    mine, whole = buf[bounds[me]:bounds[me + 1]], buf[:bounds[-1]]
    if world == 1:
        if out is not None:
            out.copy_(mine)
        return Done()
    progress.mark("reduce", group)
    if backend(group) == "gloo":
        if scratch is None:
            scratch = torch.empty(owners_scratch(sizes, group), dtype=buf.dtype, device=buf.device)
        work = _gloo_sum_pieces(mine if out is None else out, whole, sizes, group, scratch)
    else:
        works = [dist.reduce(buf[bounds[r]:bounds[r + 1]], dst=global_rank(group, r), op=SUM, group=group,
                             async_op=True) for r in range(world) if sizes[r]]
        work = Joined(works, None if out is None else lambda: out.copy_(mine))
    return instrument.issued("reduce", work, group, whole)


def _bounds(sizes: Sequence[int]) -> list[int]:
    """Where each rank's piece begins, and the end of the last: piece r is ``[b[r], b[r + 1])``."""
    return [0, *itertools.accumulate(sizes)]


def _gloo_sum_pieces(out: torch.Tensor, inp: torch.Tensor, sizes: Sequence[int], group: object,
                     scratch: torch.Tensor) -> Joined:
    """gloo's reduce-scatter: ``out`` = the sum over ranks of their ``inp`` piece of mine (pieces
    of ``sizes``, in rank order), through one all-to-all into ``scratch`` and a rank-order sum."""
    world, me = world_size(group), dist.get_rank(group)
    n, bounds = sizes[me], _bounds(sizes)
    mine = inp[bounds[me]:bounds[me + 1]]
    if world == 2:
        other = 1 - me
        got = scratch[:n]
        splits_in, splits_out = [0, 0], [0, 0]
        splits_in[other], splits_out[other] = sizes[other], n  # send the other its piece, receive mine
        work = dist.all_to_all_single(got, inp[bounds[other]:bounds[other + 1]], splits_out, splits_in,
                                      group=group, async_op=True)
        pieces = [mine, got] if me == 0 else [got, mine]
    else:
        got = scratch[:world * n]
        work = dist.all_to_all_single(got, inp, [n] * world, list(sizes), group=group, async_op=True)
        pieces = list(got.view(world, n)) if n else []

    def add_pieces() -> None:
        if n:
            torch.add(pieces[0], pieces[1], out=out)
            for piece in pieces[2:]:
                out.add_(piece)

    return Joined([work], add_pieces)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> Handle:
    """``out[r * n:(r + 1) * n]`` = rank r's ``inp`` (n elements). On gloo: ``inp`` is copied
    into its place in ``out`` (unless it is that place) and every rank broadcasts its place."""
    world = world_size(group)
    if world == 1:
        out.copy_(inp)
        return Done()
    progress.mark("all_gather", group)
    if backend(group) != "gloo":
        return instrument.issued("all_gather", _all_gather_single(out, inp, group=group, async_op=True), group,
                                 out)
    pieces = out.view(world, -1)
    mine = pieces[dist.get_rank(group)]
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp.reshape(-1))
    works = [dist.broadcast(pieces[r], src=global_rank(group, r), group=group, async_op=True)
             for r in range(world)]
    return instrument.issued("all_gather", Joined(works), group, out)


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
    """``outs[r]`` on ``dst`` (a rank of ``group``) = rank r's ``inp``; ``outs`` is None on the other ranks."""
    if world_size(group) == 1:
        outs[0].copy_(inp)
        return Done()
    progress.mark("gather", group)
    work = dist.gather(inp, gather_list=list(outs) if outs is not None else None, dst=global_rank(group, dst),
                       group=group, async_op=True)
    return instrument.issued("gather", work, group, inp, ranks=world_size(group))


def global_rank(group: object, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


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


class SizedPool:
    """Buffers kept by (numel, dtype, device) once given back, and handed out again for the same
    shape (a transformer's blocks all have one): ZeRO++'s int8 codes, scales and dequantized
    pieces, which a step would otherwise allocate, and page-fault, afresh for every collective.
    What it holds is bounded by the most buffers of one shape in use at once."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._made: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, torch.device(device))]
        if free:
            return free.pop()
        t = torch.empty(numel, dtype=dtype, device=device)
        self._made.append(t)
        return t

    def give(self, *tensors: torch.Tensor) -> None:
        """Back to the pool: the caller no longer reads or writes them."""
        for t in tensors:
            self._free[(t.numel(), t.dtype, t.device)].append(t)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer it made (for memory reports)."""
        return list(self._made)

    def clear(self) -> None:
        self._free.clear()
        self._made.clear()
