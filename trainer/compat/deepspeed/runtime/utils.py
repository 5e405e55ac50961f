"""``deepspeed.runtime.utils``: the helpers training scripts call themselves."""
from __future__ import annotations

import gc
import random
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..pipe.partition import balanced, uniform

_GB = 1024 ** 3


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators with ``seed`` (DeepSpeed's helper: scripts call
    it before building a model, so every rank builds the same weights)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prefix_sum_inc(weights: Sequence) -> list:
    """Inclusive running sums: ``[3, 4, 5] -> [3, 7, 12]``."""
    sums: list = []
    for w in weights:
        sums.append(w if not sums else sums[-1] + w)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` runs whose lengths differ by at most one
    (the pipeline's ``"uniform"`` rule, DeepSpeed's arithmetic: the longer runs first)."""
    return uniform(num_items, num_parts)


def partition_balanced(weights: Sequence, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., len(weights)]`` of ``num_parts`` contiguous runs of ``weights`` as
    evenly weighted as a contiguous cut allows (the pipeline's ``"parameters"`` rule)."""
    return balanced(list(weights), num_parts)


class PartitionedTensor:
    """A tensor cut into ``group``'s size runs of its flattened elements (``partition_uniform``'s
    runs, the longer first), this rank keeping its own run (``local_data``): DeepSpeed's helper for
    passing a tensor between pipeline stages in pieces. ``full()`` gathers the runs back into the
    original shape; ``to_meta()`` / ``from_meta()`` carry the shape and the cut as one long tensor
    (DeepSpeed's layout: number of dimensions, the sizes, number of parts, rank, boundaries)."""

    def __init__(self, tensor: torch.Tensor, group, partition_meta=None) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().reshape(-1)[start:stop].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group, device=None) -> "PartitionedTensor":
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta.dtype={meta.dtype}; valid: torch.long (to_meta())")
        values = meta.tolist()
        ndims = values[0]
        part = cls.__new__(cls)
        part.group = group
        part.orig_size = values[1:1 + ndims]
        part.num_parts, part.rank = values[1 + ndims], values[2 + ndims]
        part.partition = values[3 + ndims:]
        if part.num_parts != dist.get_world_size(group=group) or part.rank != dist.get_rank(group=group):
            raise ValueError(f"PartitionedTensor.from_meta: meta for rank {part.rank} of {part.num_parts}, this is "
                             f"rank {dist.get_rank(group=group)} of {dist.get_world_size(group=group)}")
        part.orig_device = torch.device(device) if device is not None else local_part.device
        part.local_data = local_part
        return part

    def full(self, device=None) -> torch.Tensor:
        sizes = [self.partition[r + 1] - self.partition[r] for r in range(self.num_parts)]
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=self.local_data.dtype, device=self.local_data.device)
        mine[:self.local_data.numel()] = self.local_data
        if self.num_parts == 1:
            pieces = [mine]
        else:
            pieces = [torch.empty_like(mine) for _ in range(self.num_parts)]
            dist.all_gather(pieces, mine, group=self.group)
        flat = torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
        return flat.view(self.orig_size).to(device if device is not None else self.orig_device)

    def to_meta(self) -> torch.Tensor:
        values = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(values, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, print ``message`` and the accelerator's allocated/reserved memory (current and
    peak, GB) and the host's used memory, on rank 0 only, then reset the peak counters, as
    DeepSpeed's helper; without it, nothing (DeepSpeed's calls inside its engine pass no ``force``)."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    acc = get_accelerator()
    cuda = acc.device_name() == "cuda"
    reserved = torch.cuda.memory_reserved() if cuda else 0
    max_reserved = torch.cuda.max_memory_reserved() if cuda else 0
    print(message)
    print(f"MA {round(acc.memory_allocated() / _GB, 2)} GB Max_MA {round(acc.max_memory_allocated() / _GB, 2)} GB "
          f"CA {round(reserved / _GB, 2)} GB Max_CA {round(max_reserved / _GB)} GB")
    try:
        import psutil
    except ImportError:  # psutil is optional here: the host line needs it
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        print(f"CPU Virtual Memory:  used = {round((vm.total - vm.available) / _GB, 2)} GB, percent = {vm.percent}%")
    acc.reset_peak_memory_stats()


__all__ = ["set_random_seed", "prefix_sum_inc", "partition_uniform", "partition_balanced", "PartitionedTensor",
           "see_memory_usage"]
