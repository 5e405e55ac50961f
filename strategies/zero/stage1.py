"""ZeRO stage 1: optimizer states (and fp32 masters) partitioned; gradients replicated.

Gradients: every rank keeps the *full* gradient, like DDP, in one flat buffer per param group in
the working dtype, laid out like the parameters; each ``p.grad`` is a view into it, so autograd
accumulates micro-batches in place. Inside ``no_sync()`` nothing is communicated. After the
backward of the last micro-batch the buffer is reduced in chunks - the same range ``[s, e)`` of
every rank's partition, staged side by side in ``reduce_dtype`` - with either an all-reduce (gloo:
faster there) or a ``reduce_scatter_tensor`` (NCCL). Each rank keeps only its own slice of the
result, averaged, written back into its partition of the gradient buffer; the rest of the buffer
is left unreduced and must not be read (``p.grad`` is only valid inside this rank's partition).

Memory per rank: 2Psi (params) + 2Psi (grads) + 12Psi/N (master + Adam) in bf16-mixed.
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from .comm import BufferPool, InFlight, InFlightQueue, all_reduce_sum, reduce_scatter_sum
from .flat_buffer import FlatParamGroup
from .layout import partition_chunks
from .strategy import ZeroStrategy


class ReplicatedGradients:
    """Full gradients in flat buffers; reduce-and-keep-my-slice after the last micro-batch."""

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, bucket_numel: int, queue: InFlightQueue, group: object = None) -> None:
        if reduce_mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce_mode={reduce_mode!r}; valid choices: all_reduce, reduce_scatter")
        self.flat_groups = list(flat_groups)
        self.rank, self.reduce_dtype, self.reduce_mode = rank, reduce_dtype, reduce_mode
        self.bucket_numel, self.queue, self.group = bucket_numel, queue, group
        self.buffers = [torch.zeros_like(fg.flat) for fg in self.flat_groups]
        self.views = [[fg.view(i, buf) for i in range(len(fg.params))]
                      for fg, buf in zip(self.flat_groups, self.buffers)]
        world = self.flat_groups[0].layout.world_size if self.flat_groups else 1
        chunk = max([e - s for fg in self.flat_groups
                     for s, e in partition_chunks(fg.layout.partition_numel, world, bucket_numel)] or [1])
        # staging for one chunk of every rank, plus my reduce-scatter output
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.pool = BufferPool((world + 1) * chunk, reduce_dtype, device)
        self.before_backward()

    def before_backward(self) -> None:
        """Make every ``p.grad`` a view of the flat buffer again (someone may have set it to None
        or replaced it; a replacement's values are kept)."""
        for fg, views in zip(self.flat_groups, self.views):
            for p, v in zip(fg.params, views):
                g = p.grad
                if g is None or g.data_ptr() != v.data_ptr():
                    if g is not None:
                        v.copy_(g)
                    p.grad = v

    def after_backward(self, sync: bool) -> None:
        if sync:
            self.reduce()

    def reduce(self) -> None:
        """Collective: average the gradient over ranks; this rank keeps its partition."""
        for fg, buf in zip(self.flat_groups, self.buffers):
            layout = fg.layout
            world, p = layout.world_size, layout.partition_numel
            for s, e in partition_chunks(p, world, self.bucket_numel):
                self._launch(buf, world, p, s, e)
        self.queue.wait_all()

    def _launch(self, buf: torch.Tensor, world: int, p: int, s: int, e: int) -> None:
        n, me = e - s, self.rank
        space = self.pool.acquire((world + 1) * n)
        staging, out = space[:world * n], space[world * n:]
        for r in range(world):
            staging[r * n:(r + 1) * n].copy_(buf[r * p + s:r * p + e])
        if self.reduce_mode == "all_reduce":
            handle, mine = all_reduce_sum(staging, self.group), staging[me * n:(me + 1) * n]
        else:
            handle, mine = reduce_scatter_sum(out, staging, self.group), out

        def keep_mine() -> None:
            buf[me * p + s:me * p + e].copy_(mine.div_(world))
            self.pool.release(space)

        self.queue.push(InFlight((handle,), (space,), keep_mine, "zero1 reduce"))

    def partitions(self) -> list[torch.Tensor]:
        return [fg.partition(self.rank, buf) for fg, buf in zip(self.flat_groups, self.buffers)]

    def zero(self) -> None:
        for buf in self.buffers:
            buf.zero_()

    def persistent(self) -> list[torch.Tensor]:
        return list(self.buffers)

    def comm_buffers(self) -> list[torch.Tensor]:
        return list(self.pool.buffers)

    def close(self) -> None:
        for fg in self.flat_groups:
            for p in fg.params:
                p.grad = None
        self.pool.clear()


class ZeroStage1(ZeroStrategy):
    """ZeRO-1: each rank steps the optimizer on its own slice of the fp32 masters."""

    name = "zero1"
    stage = 1

    def _build_gradients(self) -> ReplicatedGradients:
        return ReplicatedGradients(self.flat_groups, self.global_rank, self.config.torch_reduce_dtype,
                                   self.reduce_mode, self.config.reduce_bucket_size, self.queue,
                                   self.group)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate locally; the next backward outside this context reduces."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev
