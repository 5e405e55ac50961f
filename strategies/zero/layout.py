"""Partition arithmetic for ZeRO, as pure functions of sizes: no tensors, no process group.

One optimizer param group is laid out in a flat buffer, parameter after parameter, in the group's
order. The total is padded up to a multiple of ``world_size * alignment``, so the buffer splits into
``world_size`` equal contiguous *partitions*; rank ``r`` owns ``[r * P, (r + 1) * P)``. A parameter
may straddle partitions: the part of it inside one partition is a :class:`Piece`.

Two ways of cutting the work into buckets are planned here too:

* :func:`flat_buckets` - contiguous ranges of one group's flat buffer, packed in *reverse* parameter
  order (the order backward produces gradients in). ZeRO-2 reduces these while backward runs.
* :func:`partition_chunks` - the same range ``[s, e)`` of every rank's partition. Gathered (or
  reduce-scattered) together they form equal per-rank chunks, which is what
  ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamSpan:
    """Where one parameter sits in its group's flat buffer."""

    index: int  # position in the group's parameter list
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one rank's partition."""

    index: int  # parameter position in the group
    rank: int  # owner of this piece
    param_start: int  # first element within the (flattened) parameter
    partition_start: int  # first element within the owner's partition
    numel: int


@dataclass(frozen=True)
class GroupLayout:
    spans: tuple[ParamSpan, ...]
    numel: int  # sum of the parameters' sizes
    padded_numel: int  # numel rounded up to a multiple of world_size * alignment
    world_size: int

    @property
    def partition_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def partition_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s partition in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        p = self.partition_numel
        return rank * p, (rank + 1) * p

    def owner(self, flat_index: int) -> int:
        if not 0 <= flat_index < self.padded_numel:
            raise ValueError(f"flat_index={flat_index} is outside [0, {self.padded_numel})")
        return flat_index // self.partition_numel

    def pieces_of(self, index: int) -> list[Piece]:
        """How parameter ``index`` splits over the ranks' partitions, in element order."""
        span = self.spans[index]
        return _cut(span.index, span.offset, span.end, self.partition_numel)

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces inside ``rank``'s partition, in flat order (padding excluded)."""
        lo, hi = self.partition_range(rank)
        out: list[Piece] = []
        for span in self.spans:
            if span.end <= lo or span.offset >= hi or span.numel == 0:
                continue
            out.extend(pc for pc in self.pieces_of(span.index) if pc.rank == rank)
        return out


def _cut(index: int, start: int, end: int, partition_numel: int) -> list[Piece]:
    out = []
    pos = start
    while pos < end:
        rank = pos // partition_numel
        stop = min(end, (rank + 1) * partition_numel)
        out.append(Piece(index, rank, pos - start, pos - rank * partition_numel, stop - pos))
        pos = stop
    return out


def build_layout(numels: Sequence[int], world_size: int, alignment: int = 1) -> GroupLayout:
    """Lay parameters of the given sizes end to end and pad for ``world_size`` equal partitions,
    each a multiple of ``alignment`` elements."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if alignment < 1:
        raise ValueError(f"alignment={alignment} must be >= 1")
    spans, offset = [], 0
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}]={n} must be >= 0")
        spans.append(ParamSpan(i, offset, int(n)))
        offset += int(n)
    unit = world_size * alignment
    padded = -(-offset // unit) * unit
    return GroupLayout(tuple(spans), offset, padded, world_size)


# ---------------------------------------------------------------------------- buckets

@dataclass(frozen=True)
class FlatBucket:
    """A contiguous range ``[lo, hi)`` of one group's flat buffer, reduced as one message."""

    lo: int
    hi: int
    indices: tuple[int, ...]  # parameters inside, in the order backward is expected to fill them

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def flat_buckets(layout: GroupLayout, reduce_bucket_size: int) -> list[FlatBucket]:
    """Pack the group's parameters, last first, into contiguous ranges of at most ``reduce_bucket_size``
    elements; a parameter larger than ``reduce_bucket_size`` gets a bucket of its own. Empty parameters are
    skipped. The result is in expected completion order (the last parameters' bucket first)."""
    if reduce_bucket_size < 1:
        raise ValueError(f"reduce_bucket_size={reduce_bucket_size} must be >= 1")
    buckets: list[FlatBucket] = []
    cur: list[ParamSpan] = []
    for span in reversed(layout.spans):
        if span.numel == 0:
            continue
        if cur and cur[-1].end - span.offset > reduce_bucket_size:
            buckets.append(_bucket(cur))
            cur = []
        cur.insert(0, span)  # spans are walked backwards: keep cur in flat order
    if cur:
        buckets.append(_bucket(cur))
    return buckets


def _bucket(spans: list[ParamSpan]) -> FlatBucket:
    return FlatBucket(spans[0].offset, spans[-1].end, tuple(s.index for s in reversed(spans)))


def intersect(lo: int, hi: int, start: int, end: int) -> tuple[int, int] | None:
    """``[lo, hi) & [start, end)`` or None when empty."""
    a, b = max(lo, start), min(hi, end)
    return (a, b) if a < b else None


@dataclass(frozen=True)
class Run:
    """``numel`` elements at ``offset`` of a bucket that all belong to ``rank``."""

    rank: int
    offset: int
    numel: int


def owner_runs(layout: GroupLayout, bucket: FlatBucket) -> list[Run]:
    """The bucket cut at partition boundaries: one run per owning rank, in bucket order."""
    runs = []
    for rank in range(layout.world_size):
        hit = intersect(bucket.lo, bucket.hi, *layout.partition_range(rank))
        if hit:
            runs.append(Run(rank, hit[0] - bucket.lo, hit[1] - hit[0]))
    return runs


def partition_chunks(partition_numel: int, world_size: int, allgather_bucket_size: int) -> list[tuple[int, int]]:
    """Cut a partition into ranges ``[s, e)`` so that ``world_size`` ranks' chunks together hold
    at most ``allgather_bucket_size`` elements (at least one element per rank)."""
    if allgather_bucket_size < 1:
        raise ValueError(f"allgather_bucket_size={allgather_bucket_size} must be >= 1")
    step = max(1, allgather_bucket_size // world_size)
    return [(s, min(s + step, partition_numel)) for s in range(0, partition_numel, step)]
