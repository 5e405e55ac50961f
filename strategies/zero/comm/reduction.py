"""Bucketed gradient reduction during backward: the machinery ZeRO-1 (``stage1.ReplicatedGradients``)
and ZeRO-2 (``stage2.PartitionedGradients``) share.

Buckets are planned once from the parameter sizes (``layout.flat_buckets``): contiguous ranges of
one group's flat layout, at most ``reduce_bucket_size`` elements, the latest parameters first. A
post-accumulate-grad hook on every trainable parameter (:class:`~.hooks.GradientHooks`) marks its
slot filled; complete buckets are launched strictly in plan order, so every rank issues the same
collectives in the same order even if autograd visits parameters in a different order or some get
no gradient (a complete bucket whose predecessor is still filling waits for it). Each launched
reduction is filed in the in-flight layer (``inflight.Work.BUCKETS``) and lands while backward goes
on; ``flush()`` launches what is left and waits for all.

``reduce_mode``: ``all_reduce`` all-reduces a bucket; ``reduce_scatter`` (what "auto" picks except
on gloo beyond 2 ranks, ``ZeroConfig.resolved_reduce_mode``) cuts it at partition boundaries and
sums each piece onto its owner only (a flat bucket's pieces are uneven, so this is the
reduce-scatter that fits the contiguous layout: ``comm.reduce_to_owners``, on gloo one all-to-all
that sends each piece only to its owner, into a pooled scratch buffer of the received copies, on
NCCL one ``reduce`` per owner). A bucket mostly lies in one partition, so its bytes go one way:
half what an all-reduce moves. Stage 2 lands the sum straight in its gradient partition while that is zeros
(the first micro-batch; with 2 ranks on gloo the partition is the scratch);
``quantized`` (ZeRO++ qgZ, ``quantize_gradients``; stage 2 only) sends each owner its piece as
block-wise int8 in one all-to-all, and the owner sums the pieces in fp32 (``quantized.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .collectives import BufferPool, all_reduce_sum, owners_scratch, reduce_to_owners, world_size
from ..flat_buffer import FlatParamGroup
from ..hooks import GradientHooks
from .inflight import InFlight, InFlightQueue, Work
from ..layout import FlatBucket, Run, flat_buckets, intersect, owner_runs
from .quantized import Quantization


@dataclass
class Bucket:
    """One planned bucket and its state during the current backward."""

    group: int
    flat: FlatBucket
    slots: dict[int, tuple[int, int]]  # parameter index -> (offset in bucket, numel)
    runs: list[Run]  # the bucket cut at partition boundaries
    mine: tuple[int, int, int] | None  # (offset in bucket, offset in my partition, numel)
    buffer: torch.Tensor | None = None
    filled: set[int] = field(default_factory=set)
    launched: bool = False
    #: this rank's piece of the kept gradient is zeros (zeroed, nothing delivered since): a
    #: reduction may land in it directly (:meth:`BucketedReduction._landing`)
    clean: bool = True

    @property
    def complete(self) -> bool:
        return len(self.filled) == len(self.slots)

    def reset(self) -> None:
        self.buffer, self.launched = None, False
        self.filled.clear()


class BucketedReduction:
    """The machinery both stage 1 and stage 2 use to reduce gradients *during* backward.

    The hooks (``hooks.GradientHooks``) call ``_grad_ready``, which marks the slot filled
    (``_fill``) and launches the complete buckets in plan order. A subclass says where a bucket's
    gradient comes from (``_fill`` / ``_source``), what happens to a parameter that got no
    gradient (``_missing``) and where this rank's reduced part goes (``_deliver``); ``_active()``
    False makes the hooks reduce nothing (stage 1 inside ``no_sync()``, whose ``_grad_ready``
    still moves each gradient into its buffer)."""

    label = "reduce"

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, reduce_bucket_size: int, queue: InFlightQueue, order: dict[int, int],
                 group: object = None, quant: Quantization = Quantization()) -> None:
        """``order`` maps ``id(param)`` to its position in ``module.parameters()``; buckets are
        launched in the order backward is expected to complete them (latest parameters first).
        ``quant``: the block size of ``reduce_mode="quantized"``."""
        if reduce_mode not in ("all_reduce", "reduce_scatter", "quantized"):
            raise ValueError(f"reduce_mode={reduce_mode!r}; valid choices: all_reduce, reduce_scatter, quantized")
        self.quant = quant
        self.flat_groups = list(flat_groups)
        self.rank, self.reduce_mode, self.queue, self.group = rank, reduce_mode, queue, group
        self.reduce_dtype = reduce_dtype
        #: the divisor of every gradient: the whole world, also for an expert flat group reduced
        #: over its expert-data-parallel group only (``zero/experts.py``)
        self.world = world_size(group)
        buckets = []
        for gi, fg in enumerate(self.flat_groups):
            lo, hi = fg.layout.partition_range(fg.rank)
            for fb in flat_buckets(fg.layout, reduce_bucket_size):
                slots = {i: (fg.layout.spans[i].offset - fb.lo, fg.layout.spans[i].numel) for i in fb.indices}
                hit = intersect(fb.lo, fb.hi, lo, hi)
                mine = (hit[0] - fb.lo, hit[0] - lo, hit[1] - hit[0]) if hit else None
                buckets.append(Bucket(gi, fb, slots, owner_runs(fg.layout, fb), mine))
        # the bucket holding the earliest parameters completes last
        buckets.sort(key=lambda b: -min(order[id(self.flat_groups[b.group].params[i])] for i in b.slots))
        self.buckets = buckets
        self._next = 0  # first bucket not launched in this backward
        device = self.flat_groups[0].flat.device if self.flat_groups else torch.device("cpu")
        self.pool = BufferPool(max([b.flat.numel for b in buckets] or [1]), reduce_dtype, device)
        self._slots = [(bi, i, self.flat_groups[b.group].params[i]) for bi, b in enumerate(buckets) for i in b.slots]
        self._hooks: GradientHooks | None = None
        self.open()

    def open(self) -> None:
        """Install the gradient hooks if they are not (at set-up, and before the backward of a
        ``fit`` after ``close()``: without them that fit would step on zero gradients)."""
        if self._hooks is None:
            self._hooks = GradientHooks(self._slots, self._grad_ready)

    # ---------------------------------------------------------------- what a stage supplies
    def _active(self) -> bool:
        return True

    def _fill(self, b: Bucket, index: int, p: nn.Parameter) -> None:
        """Parameter ``index`` of bucket ``b`` has its gradient in ``p.grad``."""

    def _missing(self, b: Bucket, index: int) -> None:
        """Parameter ``index`` got no gradient in this backward (called at the flush)."""

    def _source(self, b: Bucket) -> tuple[torch.Tensor, bool]:
        """The bucket's gradient to reduce in place, and whether it came from ``self.pool``."""
        raise NotImplementedError

    def _deliver(self, b: Bucket, buf: torch.Tensor) -> None:
        """``buf`` holds the bucket summed over ranks (at least inside ``b.mine``)."""
        raise NotImplementedError

    def _landing(self, b: Bucket) -> torch.Tensor | None:
        """Where a reduce-scatter may put this rank's summed piece of ``b`` instead of the bucket
        (then :meth:`_landed` is called instead of :meth:`_deliver`); None: in the bucket."""
        return None

    def _landed(self, b: Bucket, summed: torch.Tensor) -> None:
        """My piece of ``b``, summed over ranks, landed in ``summed`` (:meth:`_landing`'s)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def _grad_ready(self, bi: int, index: int, p: nn.Parameter) -> None:
        """The hook: parameter ``index`` of bucket ``bi`` has its gradient accumulated."""
        if self._active():
            self._take(bi, index, p)

    def _take(self, bi: int, index: int, p: nn.Parameter) -> None:
        b = self.buckets[bi]
        if b.launched or index in b.filled:
            raise RuntimeError(
                f"{self.label}: a parameter received its gradient twice in one backward (several "
                "backward calls per micro-batch, or reentrant use): call strategy.backward() once "
                "per micro-batch")
        self._fill(b, index, p)
        b.filled.add(index)
        if b.complete:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        fg = self.flat_groups[b.group]  # its process group: the world's, or an expert group's EDP group
        buf, pooled = self._source(b)
        keep: tuple[torch.Tensor, ...] = ()
        summed = land = out = piece = None
        release = [buf] if pooled else []  # pooled buffers, given back once the reduction landed
        if self.reduce_mode == "all_reduce":
            handles = (all_reduce_sum(buf, fg.group),)
        elif self.reduce_mode == "quantized":  # the fp32 sum lands in my piece of an fp32 bucket
            piece = buf[b.mine[0]:b.mine[0] + b.mine[2]] if b.mine is not None else None
            out = piece if piece is not None and buf.dtype == torch.float32 else None
            handles, keep, summed = self.quant.reduce(buf, self._pieces(b), fg.rank, fg.group, out=out)
        else:  # on gloo one all-to-all, each piece to its owner only (comm.reduce_to_owners)
            sizes = [n for _, n in self._pieces(b)]
            need = owners_scratch(sizes, fg.group)
            land = self._landing(b) if b.clean else None
            if land is not None and need > land.numel():
                land = None
            # the received pieces: a pooled buffer, given back once summed (the pool keeps one
            # bucket per reduction in flight at once; a fresh one would page-fault every time);
            # beyond 2 ranks a piece's copies may outgrow a bucket, and get their own
            if land is not None or not need:
                scratch = land
            elif need <= self.pool.buffer_numel:
                scratch = self.pool.acquire(need)
                release.append(scratch)
            else:
                scratch = torch.empty(need, dtype=buf.dtype, device=buf.device)
            handles = (reduce_to_owners(buf, sizes, fg.group, out=land, scratch=scratch),)
            keep = () if scratch is None else (scratch,)

        def done() -> None:
            if summed is not None:  # qgZ (also where I own nothing: it gives its buffers back)
                got = summed()
                if out is None and piece is not None:  # summed outside the bucket (not fp32)
                    piece.copy_(got)
            if land is not None:
                self._landed(b, land)
            else:
                self._deliver(b, buf)
            for t in release:
                self.pool.release(t)

        b.buffer, b.launched, b.clean = None, True, False
        self.queue.push(InFlight(handles, (buf, *keep), done, self.label))

    def _pieces(self, b: Bucket) -> list[tuple[int, int]]:
        """Each rank's (offset, numel) in bucket ``b`` (numel 0 for a rank owning none of it)."""
        pieces = [(0, 0)] * self.flat_groups[b.group].layout.world_size
        for r in b.runs:
            pieces[r.rank] = (r.offset, r.numel)
        return pieces

    def flush(self) -> None:
        """Launch what is left in plan order, wait for all, and reset for the next backward."""
        for b in self.buckets[self._next:]:
            for i in b.slots:
                if i not in b.filled:
                    self._missing(b, i)
            self._launch(b)
        self.queue.wait(Work.BUCKETS)
        self._next = 0
        for b in self.buckets:
            b.reset()

    #: the gradient buffers this reduction keeps between steps (set by the stage's subclass)
    kept: list[torch.Tensor]

    def zero(self, slots: list[int] | None = None) -> None:
        """Zero the kept buffers (group ``slots`` only: one optimizer's, the others accumulate on)."""
        for i, buf in enumerate(self.kept):
            if slots is None or i in slots:
                buf.zero_()
        for b in self.buckets:
            if slots is None or b.group in slots:
                b.clean = True

    def persistent(self) -> list[torch.Tensor]:
        return list(self.kept)

    def comm_buffers(self) -> list[torch.Tensor]:
        return list(self.pool.buffers) + self.quant.pool.buffers()

    def remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        self.pool.clear()
        self.quant.pool.clear()
