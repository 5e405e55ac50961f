"""ZeRO stage 2: optimizer states and gradients partitioned.

The full gradient is never materialised. Each trainable parameter has a post-accumulate-grad hook:
as soon as autograd has its gradient, the hook copies it (cast to ``reduce_dtype``) into its
*bucket* and frees ``p.grad``. A bucket is a contiguous range of one group's flat layout, planned
once from the parameter sizes (``layout.flat_buckets``), last parameters first, at most
``reduce_bucket_size`` elements. When a bucket is complete it is reduced asynchronously while
backward goes on (``overlap_comm``):

* ``all_reduce`` (gloo default): all-reduce the bucket, keep the part inside my partition;
* ``reduce_scatter`` (NCCL default): the bucket cut at partition boundaries, each piece summed
  only onto its owner (``dist.reduce``; a flat bucket's pieces are uneven, so this is the
  reduce-scatter that fits the contiguous layout).

The arriving piece is added, divided by the world size, into this rank's gradient partition: one
contiguous ``reduce_dtype`` buffer per group. Micro-batches accumulate there (every micro-batch is
reduced, as in DeepSpeed, so ``no_sync()`` is a null context). The strategy's ``backward()`` ends by
flushing incomplete buckets (parameters that got no gradient contribute zeros) and waiting for all.

Buckets are launched strictly in plan order, so every rank issues the same collectives in the same
order even if autograd visits parameters in a different order or some get no gradient; a complete
bucket whose predecessor is still filling waits for it.

Memory per rank: 2Psi (params) + 2Psi/N (grads, reduce_dtype="bf16") + 12Psi/N (master + Adam), plus
the pooled bucket buffers. With the default fp32 reduction the gradient partition is 4Psi/N.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from .comm import BufferPool, InFlight, InFlightQueue, all_reduce_sum, reduce_to_owner
from .flat_buffer import FlatParamGroup
from .layout import FlatBucket, Run, flat_buckets, intersect, owner_runs
from .strategy import ZeroStrategy


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

    @property
    def complete(self) -> bool:
        return len(self.filled) == len(self.slots)

    def reset(self) -> None:
        self.buffer, self.launched = None, False
        self.filled.clear()


class BucketedReduction:
    """The machinery both stage 1 and stage 2 use to reduce gradients *during* backward.

    Buckets are planned once (``layout.flat_buckets``, latest parameters first); a
    post-accumulate-grad hook on every trainable parameter marks its slot filled (``_fill``), and
    complete buckets are launched strictly in plan order, so every rank issues the same collectives
    in the same order. A subclass says where a bucket's gradient comes from (``_fill`` /
    ``_source``), what happens to a parameter that got no gradient (``_missing``) and where this
    rank's reduced part goes (``_deliver``); ``_active()`` False makes the hooks do nothing (stage
    1 inside ``no_sync()``)."""

    label = "reduce"

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, bucket_numel: int, queue: InFlightQueue, order: dict[int, int],
                 group: object = None) -> None:
        """``order`` maps ``id(param)`` to its position in ``module.parameters()``; buckets are
        launched in the order backward is expected to complete them (latest parameters first)."""
        if reduce_mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce_mode={reduce_mode!r}; valid choices: all_reduce, reduce_scatter")
        self.flat_groups = list(flat_groups)
        self.rank, self.reduce_mode, self.queue, self.group = rank, reduce_mode, queue, group
        self.reduce_dtype = reduce_dtype
        self.world = self.flat_groups[0].layout.world_size if self.flat_groups else 1
        buckets = []
        for gi, fg in enumerate(self.flat_groups):
            lo, hi = fg.layout.partition_range(rank)
            for fb in flat_buckets(fg.layout, bucket_numel):
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
        self._hooks = []
        for bi, b in enumerate(buckets):
            for i in b.slots:
                p = self.flat_groups[b.group].params[i]
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bi, i)))

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

    # ---------------------------------------------------------------- shared
    def _hook(self, bi: int, index: int):
        def on_grad(p: nn.Parameter) -> None:
            if self._active():
                self._take(bi, index, p)
        return on_grad

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
        buf, pooled = self._source(b)
        if self.reduce_mode == "all_reduce":
            handles = (all_reduce_sum(buf, self.group),)
        else:
            handles = tuple(reduce_to_owner(buf[r.offset:r.offset + r.numel], r.rank, self.group)
                            for r in b.runs)

        def done(b=b, buf=buf, pooled=pooled) -> None:
            self._deliver(b, buf)
            if pooled:
                self.pool.release(buf)

        b.buffer, b.launched = None, True
        self.queue.push(InFlight(handles, (buf,), done, self.label))

    def flush(self) -> None:
        """Launch what is left in plan order, wait for all, and reset for the next backward."""
        for b in self.buckets[self._next:]:
            for i in b.slots:
                if i not in b.filled:
                    self._missing(b, i)
            self._launch(b)
        self.queue.wait_all()
        self._next = 0
        for b in self.buckets:
            b.reset()

    def comm_buffers(self) -> list[torch.Tensor]:
        return list(self.pool.buffers)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.pool.clear()


class PartitionedGradients(BucketedReduction):
    """Bucketed reduction during backward into per-group gradient partitions."""

    label = "zero2 reduce"

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, bucket_numel: int, queue: InFlightQueue, order: dict[int, int],
                 group: object = None) -> None:
        super().__init__(flat_groups, rank, reduce_dtype, reduce_mode, bucket_numel, queue, order, group)
        self.parts = [torch.zeros(fg.layout.partition_numel, dtype=reduce_dtype, device=fg.flat.device)
                      for fg in self.flat_groups]
        #: called as ``on_reduced(group, start, numel)`` once elements [start, start + numel) of
        #: this rank's partition of ``group`` hold one backward's reduced gradient (CPU offload
        #: streams them to the host from here while backward goes on)
        self.on_reduced: Callable[[int, int, int], None] | None = None

    def _fill(self, b: Bucket, index: int, p: nn.Parameter) -> None:
        if b.buffer is None:
            b.buffer = self.pool.acquire(b.flat.numel)
        off, n = b.slots[index]
        b.buffer[off:off + n].copy_(p.grad.reshape(-1))
        p.grad = None

    def _missing(self, b: Bucket, index: int) -> None:
        if b.buffer is None:
            b.buffer = self.pool.acquire(b.flat.numel)
        off, n = b.slots[index]
        b.buffer[off:off + n].zero_()

    def _source(self, b: Bucket) -> tuple[torch.Tensor, bool]:
        return b.buffer, True

    def _deliver(self, b: Bucket, buf: torch.Tensor) -> None:
        if b.mine is not None:
            boff, poff, n = b.mine
            self.parts[b.group][poff:poff + n].add_(buf[boff:boff + n].div_(self.world))
            if self.on_reduced is not None:
                self.on_reduced(b.group, poff, n)

    def before_backward(self) -> None:
        pass

    def after_backward(self, sync: bool) -> None:
        """Flush: launch what is left in plan order (missing gradients are zeros), wait for all."""
        self.flush()

    def partitions(self) -> list[torch.Tensor]:
        return list(self.parts)

    def zero(self) -> None:
        for part in self.parts:
            part.zero_()

    def persistent(self) -> list[torch.Tensor]:
        return list(self.parts)

    def close(self) -> None:
        self.remove_hooks()


class ZeroStage2(ZeroStrategy):
    """ZeRO-2: gradients reduced into partitions during backward; optimizer steps on slices."""

    name = "zero2"
    stage = 2

    def _build_gradients(self) -> PartitionedGradients:
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        return PartitionedGradients(self.flat_groups, self.global_rank, self.config.torch_reduce_dtype,
                                    self.reduce_mode, self.buckets.reduce_bucket_size, self.queue,
                                    order, self.group)

    def _grad_bytes_per_param(self) -> int:
        return self.config.torch_reduce_dtype.itemsize
