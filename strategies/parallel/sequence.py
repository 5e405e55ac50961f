"""A sequence group's batch, cut and counted (issue 45: sequence parallelism in the Trainer).

Every rank of a sequence group gets the same batch from the loaders (they shard by the data axis
only); ``shard_sequence`` gives rank i of n its tokens ``[i*S/n, (i+1)*S/n)`` of every sequence,
and ``sequence_mean`` the loss whose mean over the group's ranks is the mean over all its tokens.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _cut(t: torch.Tensor, rank: int, size: int, dim: int) -> torch.Tensor:
    length = t.shape[dim]
    if length % size:
        raise ValueError(f"sequence parallelism: a batch tensor of shape {tuple(t.shape)} has sequence length "
                         f"{length} (dimension {dim}), which does not divide over sequence_parallel={size}; "
                         f"valid: a multiple of {size} (pad the batch, or define shard_batch on the module)")
    step = length // size
    return t.narrow(dim, rank * step, step)


def shard_sequence(batch: Any, rank: int, size: int, dim: int = 1) -> Any:
    """This rank's part of ``batch``: each tensor of 2 or more dimensions cut along ``dim`` (the
    sequence of a batch-first ``[B, S, ...]`` tensor), through lists, tuples and dicts; other
    values as they are. A dict with ``input_ids`` and no ``position_ids`` gets the whole
    sequence's ``position_ids``, cut alike, so that a Hugging Face model embeds each shard's
    tokens at their own positions."""
    if isinstance(batch, torch.Tensor):
        return _cut(batch, rank, size, dim) if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        batch = dict(batch)
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and "position_ids" not in batch:
            batch["position_ids"] = torch.arange(ids.shape[dim], device=ids.device).expand(ids.shape[0], -1)
        return {k: shard_sequence(v, rank, size, dim) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(shard_sequence(v, rank, size, dim) for v in batch)
    return batch


def sequence_mean(loss_sum: torch.Tensor, count: "torch.Tensor | int", group: Any, size: int) -> torch.Tensor:
    """``loss_sum`` x ``size`` / (``count`` summed over ``group``): the mean over the group's ranks
    of what this returns is the group's loss summed over all its tokens / all its tokens, and so
    the replicas' average gradient (DDP's, ZeRO's) is the whole sequence's. ``count``: the tokens
    this rank's ``loss_sum`` counts (labels ignored excluded). ``size`` 1: ``loss_sum / count``."""
    total = torch.as_tensor(count, dtype=torch.float64).detach().clone().to(loss_sum.device)
    if size > 1:
        dist.all_reduce(total, group=group)
    return loss_sum * (size / total).to(loss_sum.dtype)
