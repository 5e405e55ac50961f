"""ZeRO stage 2: optimizer states and gradients partitioned.

The full gradient is never materialised. Gradients are reduced bucket by bucket during backward by
:class:`~.reduction.BucketedReduction` (buckets planned once, post-accumulate-grad hooks, launched
strictly in plan order, ``overlap_comm``); here, as soon as autograd has a parameter's gradient,
it is copied (cast to ``reduce_dtype``) into its pooled bucket buffer and ``p.grad`` is freed.

The arriving piece is added, divided by the world size, into this rank's gradient partition: one
contiguous ``reduce_dtype`` buffer per group (a reduce-scatter lands there directly while that part
of the partition is zeros: ``BucketedReduction._landing``). Micro-batches accumulate there (every
micro-batch is reduced, as in DeepSpeed, so ``no_sync()`` is a null context). The strategy's
``backward()`` ends by flushing incomplete buckets (parameters that got no gradient contribute
zeros) and waiting for all.

Memory per rank: 2Psi (params) + 2Psi/N (grads, reduce_dtype="bf16") + 12Psi/N (master + Adam), plus
the pooled bucket buffers. With the default fp32 reduction the gradient partition is 4Psi/N.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .flat_buffer import FlatParamGroup
from .comm.inflight import InFlightQueue
from .comm.quantized import Quantization
from .comm.reduction import Bucket, BucketedReduction
from .strategy import ZeroStrategy


class PartitionedGradients(BucketedReduction):
    """Bucketed reduction during backward into per-group gradient partitions."""

    label = "zero2 reduce"

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, reduce_bucket_size: int, queue: InFlightQueue, order: dict[int, int],
                 group: object = None, quant: Quantization = Quantization()) -> None:
        super().__init__(flat_groups, rank, reduce_dtype, reduce_mode, reduce_bucket_size, queue, order, group,
                         quant)
        self.parts = self.kept = [
            torch.zeros(fg.layout.partition_numel, dtype=reduce_dtype, device=fg.flat.device)
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

    def _landing(self, b: Bucket) -> torch.Tensor | None:
        if b.mine is None:
            return None
        _, poff, n = b.mine
        return self.parts[b.group][poff:poff + n]

    def _landed(self, b: Bucket, summed: torch.Tensor) -> None:
        summed.div_(self.world)
        if self.on_reduced is not None:
            self.on_reduced(b.group, b.mine[1], b.mine[2])

    def before_backward(self) -> None:
        pass

    def after_backward(self, sync: bool) -> None:
        """Flush: launch what is left in plan order (missing gradients are zeros), wait for all."""
        self.flush()

    def partitions(self) -> list[torch.Tensor]:
        return list(self.parts)

    def close(self) -> None:
        self.remove_hooks()


class ZeroStage2(ZeroStrategy):
    """ZeRO-2: gradients reduced into partitions during backward; optimizer steps on slices."""

    name = "zero2"
    stage = 2

    def _build_gradients(self) -> PartitionedGradients:
        quant = Quantization(gradients=self.config.quantize_gradients,
                             block_size=self.config.quantize_block_size)
        return PartitionedGradients(*self._reduction_args(), quant=quant)

    def _grad_bytes_per_param(self) -> int:
        return self.config.torch_reduce_dtype.itemsize
