"""ZeRO stage 1: optimizer states (and fp32 masters) partitioned; gradients replicated.

Gradients: every rank keeps the *full* gradient, like DDP, in one flat buffer per param group in
the working dtype, laid out like the parameters. ``zero_grad`` does not clear the buffer: it sets
each ``p.grad`` to None, as torch's ``set_to_none`` does. The first gradient a parameter receives
after that is *copied* into its place in the buffer, and ``p.grad`` becomes a view of it, so
autograd accumulates further micro-batches in place. Compared with zeroing the buffer and adding
every gradient into it, this saves one pass over the whole buffer per step (the 118M GPT: 0.47 GB)
and turns the first micro-batch's add (two reads, one write) into a copy. A parameter that got no
gradient is zeroed in the buffer when the synchronising backward ends (or before a step reads
its partition).

Inside ``no_sync()`` nothing is communicated. During the backward of the synchronising
micro-batch the buffer is reduced bucket by bucket as the buckets become ready - the machinery
stage 2 uses too (:class:`~.reduction.BucketedReduction`: buckets planned once,
post-accumulate-grad hooks, launched strictly in plan order), overlapping communication with the
rest of backward. A bucket is all-reduced in place in the gradient buffer when ``reduce_dtype``
is the working dtype (else through a pooled ``reduce_dtype`` copy); ``reduce_scatter`` mode sums
each partition's piece onto its owner only (on gloo the received copies go to a pooled scratch
buffer, given back once summed). Each rank keeps its own slice of the result, averaged; the rest
of the buffer holds partial sums (all_reduce) or this rank's own gradients (reduce_scatter) and
must not be read (``p.grad`` is only valid inside this rank's partition after a synchronising
backward).

Memory per rank: 2Psi (params) + 2Psi (grads) + 12Psi/N (master + Adam) in bf16-mixed.

``last_backward_wins`` (set by ``zerotrain.deepspeed`` for DeepSpeed's fp32 ZeRO-1): DeepSpeed
reduces only at the end of its own engine's backward at the accumulation boundary, keeps this
rank's averaged partition for the step, and sets every ``p.grad`` to None; a second such backward
before the step reduces only what accumulated since and *replaces* the kept partition (a GAN's
``backward(real)``, ``backward(fake)``, ``step()`` steps on the fake batch's gradient alone).
Under the flag: the hooks reduce only inside this strategy's own synchronising backward (another
model's backward that reaches these parameters, e.g. a generator's loss through the
discriminator, only accumulates); after it the partitions are *held* and ``p.grad`` is None, so
gradients arriving before the next synchronising backward stay in autograd's own ``p.grad``; that
backward copies them into the buffer (overwriting the held values) and reduces them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .flat_buffer import FlatParamGroup
from .comm.inflight import InFlightQueue
from .comm.reduction import Bucket, BucketedReduction
from .strategy import ZeroStrategy


class ReplicatedGradients(BucketedReduction):
    """Full gradients in flat buffers; on a synchronising backward each bucket is reduced (and my
    slice kept) as soon as backward has finished with it."""

    label = "zero1 reduce"

    def __init__(self, flat_groups: Sequence[FlatParamGroup], rank: int, reduce_dtype: torch.dtype,
                 reduce_mode: str, reduce_bucket_size: int, queue: InFlightQueue, order: dict[int, int],
                 group: object = None, is_sync: Callable[[], bool] = lambda: True) -> None:
        super().__init__(flat_groups, rank, reduce_dtype, reduce_mode, reduce_bucket_size, queue, order, group)
        self.is_sync = is_sync
        self.buffers = self.kept = [torch.zeros_like(fg.flat) for fg in self.flat_groups]
        self.views = [[fg.view(i, buf) for i in range(len(fg.params))]
                      for fg, buf in zip(self.flat_groups, self.buffers)]
        #: groups reduced in place since they were last zeroed (several synchronising backwards
        #: between steps: manual optimization)
        self.reduced = [False] * len(self.flat_groups)
        #: groups zeroed (their ``p.grad`` set to None) since a synchronising backward last
        #: settled every parameter: some buffer regions may still hold an earlier step's values
        self.stale = [False] * len(self.flat_groups)
        #: DeepSpeed's ZeRO-1 (module docstring): set before the first backward
        self.last_backward_wins = False
        #: groups whose partition a synchronising backward reduced and that wait for the step,
        #: their ``p.grad`` None (``last_backward_wins`` only)
        self.held = [False] * len(self.flat_groups)
        self._own_backward = False  # between before_backward and after_backward
        for g in range(len(self.flat_groups)):
            self._settle_group(g)

    def before_backward(self) -> None:
        """Turn a buffer reduced in place back into something the next backward may accumulate
        into. A ``p.grad`` that is None or not the buffer's view (someone replaced it) is left to
        autograd; the hook copies what it holds after accumulating into the buffer. Under
        ``last_backward_wins`` a synchronising backward lets go of the held partitions: what it
        reduces replaces them."""
        self._own_backward = True
        if self.last_backward_wins and self.is_sync():
            self.held = [False] * len(self.flat_groups)
        for g in range(len(self.flat_groups)):
            if self.reduced[g]:
                self._restore_sum(g)

    def _restore_sum(self, g: int) -> None:
        """After an in-place reduction this rank's slice holds the average and the rest partial
        sums. Before more gradients accumulate (a second synchronising backward before the group
        is zeroed): keep this rank's slice as the sum over ranks (average times world) and zero
        the rest, so that the next reduction sums (previous sum + every rank's new gradients)
        exactly once; the slice is then averaged again. Reduction is linear, so this equals one
        reduction of everything accumulated, as DDP gives."""
        buf = self.buffers[g]
        lo, hi = self.flat_groups[g].layout.partition_range(self.flat_groups[g].rank)
        buf[:lo].zero_()
        buf[hi:].zero_()
        buf[lo:hi].mul_(self.world)
        self.reduced[g] = False

    @staticmethod
    def _settle(p: nn.Parameter, v: torch.Tensor) -> None:
        """Make ``p.grad`` the buffer's view ``v``, holding what ``p.grad`` held (zeros for None)."""
        g = p.grad
        if g is None:
            v.zero_()
        elif g.data_ptr() != v.data_ptr():
            v.copy_(g)
        else:
            return
        p.grad = v

    def _settle_group(self, g: int) -> None:
        for p, v in zip(self.flat_groups[g].params, self.views[g]):
            self._settle(p, v)
        self.stale[g] = False

    # the bucket machinery: a gradient is moved into the buffer whenever it arrives; reduce only
    # when synchronising
    def _grad_ready(self, bi: int, index: int, p: nn.Parameter) -> None:
        b = self.buckets[bi]
        if self.held[b.group]:  # the buffer waits for the step: accumulate in p.grad (see before_backward)
            return
        self._settle(p, self.views[b.group][index])
        if self._active():
            self._take(bi, index, p)

    def _active(self) -> bool:
        return self.is_sync() and (self._own_backward or not self.last_backward_wins)

    def _missing(self, b: Bucket, index: int) -> None:
        self._settle(self.flat_groups[b.group].params[index], self.views[b.group][index])

    def _source(self, b: Bucket) -> tuple[torch.Tensor, bool]:
        region = self.buffers[b.group][b.flat.lo:b.flat.hi]
        if region.dtype == self.reduce_dtype:
            return region, False
        staged = self.pool.acquire(b.flat.numel)
        staged.copy_(region)
        return staged, True

    def _deliver(self, b: Bucket, buf: torch.Tensor) -> None:
        if b.mine is None:
            return
        boff, poff, n = b.mine
        got = buf[boff:boff + n].div_(self.world)
        dst = self.buffers[b.group][b.flat.lo + boff:b.flat.lo + boff + n]
        if got.data_ptr() != dst.data_ptr():  # reduced through a staging copy
            dst.copy_(got)

    def after_backward(self, sync: bool) -> None:
        self._own_backward = False
        if sync:
            self.flush()  # every parameter got its gradient or was settled as missing
            self.reduced = [not self.last_backward_wins] * len(self.flat_groups)
            self.stale = [False] * len(self.flat_groups)
            if self.last_backward_wins:
                self.held = [True] * len(self.flat_groups)
                for fg in self.flat_groups:
                    for p in fg.params:
                        p.grad = None

    def zero(self, slots: list[int] | None = None) -> None:
        """Set the groups' ``p.grad`` to None (groups ``slots`` only: one optimizer's, the others
        accumulate on); their next gradients are copied into the buffer, not added to it."""
        for g, fg in enumerate(self.flat_groups):
            if slots is None or g in slots:
                for p in fg.params:
                    p.grad = None
                self.reduced[g] = self.held[g] = False
                self.stale[g] = True

    def reduce(self) -> None:
        """Collective: average the whole gradient over ranks; this rank keeps its partition."""
        self.flush()

    def partitions(self) -> list[torch.Tensor]:
        for g in range(len(self.flat_groups)):
            if self.stale[g]:  # read before a synchronising backward settled it (a step without one)
                self._settle_group(g)
        return [fg.partition(fg.rank, buf) for fg, buf in zip(self.flat_groups, self.buffers)]

    def close(self) -> None:
        self.remove_hooks()
        for fg in self.flat_groups:
            for p in fg.params:
                p.grad = None


class ZeroStage1(ZeroStrategy):
    """ZeRO-1: each rank steps the optimizer on its own slice of the fp32 masters."""

    name = "zero1"
    stage = 1
    #: DeepSpeed's fp32 ZeRO-1 semantics of several backwards per step (``ReplicatedGradients``);
    #: ``zerotrain.deepspeed`` sets it before ``setup``
    last_backward_wins = False

    def _build_gradients(self) -> ReplicatedGradients:
        grads = ReplicatedGradients(*self._reduction_args(), is_sync=lambda: self._sync)
        grads.last_backward_wins = self.last_backward_wins
        return grads
