"""Pipeline x ZeRO-1: each stage's optimizer state partitioned over its data-parallel group.

Every rank of a stage's data-parallel group (the stage in every replica) holds the stage's whole
working parameters, as flat buffers (``zero.flat_buffer``), but the fp32 master weights and the
optimizer state of one partition only (``zero.layout``: the group's ``replicas`` equal
partitions; ``zero.sharded_optimizer``: the user's optimizer re-targeted onto the master slices).
The ZeRO strategies are built from the same pieces over the world; here the "world" is the
stage's replicas, and a rank's place in it is its replica.

A step, once the schedule has run every micro-batch (so that each ``p.grad`` holds the stage's
gradient for this replica's batch, tied gradients already summed over their stages):

* ``reduce``: per param group, the gradients laid out like the flat buffer in fp32, all-reduced
  (SUM) over the group and divided by ``replicas``; this rank keeps its partition as the fp32
  gradient of its master slice. One all-reduce per group after the whole schedule, not a
  bucketed reduction during backward: a stage runs ``m`` backwards per step and only the last
  one's gradients are final, and gloo has no reduce-scatter.
* ``local_sq_norm``: the squared norm of this rank's partition, counting a tied weight only on
  its lowest owning stage; the strategy sums it over the world (all stages, all replicas: each
  element lives in exactly one partition) for the global norm.
* ``step``: the optimizer steps the master slices; ``refresh`` all-gathers (on gloo: broadcasts)
  the updated slices into every replica's working buffer.

Checkpoints keep the strategy-neutral per-parameter format (``zero.shards``): each rank saves
its partition's piece of each parameter, and loading reads back whatever ranges it now owns.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..checkpoint import ParamShard, ShardReader
from ..zero.comm.collectives import all_reduce_sum
from ..zero.config import BucketConfig
from ..zero.flat_buffer import FlatParamGroup, flatten_group
from ..zero.comm.inflight import InFlightQueue
from ..zero.layout import build_layout
from ..zero.sharded_optimizer import ShardedOptimizer
from ..zero.shards import load_partitions, partition_shards
from ..zero.strategy import trainable_groups

#: elements that one all-gather of updated slices moves (every replica's chunks together): the
#: ZeRO strategies' default, ``BucketConfig.allgather_bucket_size``
ALLGATHER_BUCKET_SIZE = BucketConfig().allgather_bucket_size


class StageZero1:
    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, param_dtype: torch.dtype,
                 rank: int, replicas: int, group: Any, uncounted: Iterable[int] = ()) -> None:
        """Collective over ``group`` (this stage's replicas; ``rank`` is the replica). ``uncounted``:
        ``id``s of the parameters whose gradient the global norm counts on another stage."""
        self.rank, self.replicas, self.group = rank, replicas, group
        self.queue = InFlightQueue(overlap=False)
        self.flat_groups: list[FlatParamGroup] = []
        masters = []
        for params in trainable_groups(optimizer, module):
            layout = build_layout([p.numel() for p in params], replicas)
            fg, master = flatten_group(params, layout, param_dtype, rank, self.queue, group)
            self.flat_groups.append(fg)
            masters.append(master)
        self.sharded = ShardedOptimizer(optimizer, masters)
        self.optimizer = optimizer
        self._counted = [self._counted_ranges(fg, set(uncounted)) for fg in self.flat_groups]
        self.grads: list[torch.Tensor] | None = None

    def _counted_ranges(self, fg: FlatParamGroup, uncounted: set[int]) -> list[tuple[int, int]]:
        """Ranges of this rank's partition that the global norm counts."""
        return [(pc.partition_start, pc.partition_start + pc.numel) for pc in fg.layout.pieces(self.rank)
                if id(fg.params[pc.index]) not in uncounted]

    # ------------------------------------------------------------------ the step
    def reduce(self) -> list[torch.Tensor]:
        """Collective: this rank's fp32 gradient slice of each group, averaged over the replicas
        (and attached to the master slices for the optimizer)."""
        if self.grads is not None:
            return self.grads
        grads = []
        for fg in self.flat_groups:
            full = torch.zeros(fg.layout.padded_numel, dtype=torch.float32, device=fg.flat.device)
            for p, span in zip(fg.params, fg.layout.spans):
                if p.grad is not None:
                    full[span.offset:span.end].copy_(p.grad.detach().reshape(-1))
            if full.numel():
                self.queue.complete(all_reduce_sum(full, self.group), full, label="pipeline zero1 reduce")
            lo, hi = fg.layout.partition_range(self.rank)
            grads.append(full[lo:hi].div_(self.replicas).clone())
        self.sharded.set_grads(grads)
        self.grads = grads
        return grads

    def local_sq_norm(self, device: torch.device) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g, ranges in zip(self.reduce(), self._counted):
            for lo, hi in ranges:
                total = total + g[lo:hi].pow(2).sum()
        return total

    def step(self) -> None:
        self.sharded.step()

    def refresh(self) -> None:
        """Collective: every replica's updated master slices into the working parameters."""
        for fg, master in zip(self.flat_groups, self.sharded.masters):
            fg.gather_from(master.detach(), self.rank, ALLGATHER_BUCKET_SIZE, self.queue, self.group)

    def zero_grad(self) -> None:
        self.sharded.clear_grads()
        self.grads = None
        for fg in self.flat_groups:
            for p in fg.params:
                p.grad = None

    # ------------------------------------------------------------------ checkpoints and memory
    def param_shards(self, names: dict[int, str]) -> dict[str, ParamShard]:
        return partition_shards(self.flat_groups, self.sharded, self.rank, names)

    def load_param_shards(self, names: dict[int, str], reader: ShardReader) -> None:
        """Collective: this rank's masters and state from the checkpoint, then the working
        parameters gathered from every replica's."""
        load_partitions(self.flat_groups, self.sharded, self.optimizer, self.rank, names, reader)
        self.refresh()
        self.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"master": list(self.sharded.masters), "optimizer": self.sharded.state_tensors()}
