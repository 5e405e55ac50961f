"""The pipeline strategy's collectives, as plain functions with every input passed explicitly.

Gradients are reduced with SUM and then divided (``ReduceOp.AVG`` is unreliable on gloo). A
parameter without a gradient on one rank takes part with zeros, so every rank posts the same
collective; it keeps no gradient only if no rank in the group had one (the optimizer then skips
it, as it would without pipelining).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import instrument


def all_reduce_grads(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None,
                     divide_by: int = 1) -> None:
    """Sum ``params``' gradients over ``group`` (one flat buffer per dtype), then divide."""
    if not params:
        return
    device = params[0].device
    has = torch.tensor([float(p.grad is not None) for p in params], device=device)
    with instrument.blocking("all_reduce", has, group):
        dist.all_reduce(has, group=group)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if has[i] > 0:
            by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = torch.cat([(params[i].grad if params[i].grad is not None
                           else torch.zeros_like(params[i])).reshape(-1) for i in idx])
        with instrument.blocking("all_reduce", flat, group):
            dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat.div_(divide_by)
        offset = 0
        for i in idx:
            p = params[i]
            view = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s values."""
    for t in tensors:
        dist.broadcast(t.data, src=src, group=group)


def sum_over_world(value: torch.Tensor) -> torch.Tensor:
    out = value.detach().clone()
    dist.all_reduce(out)
    return out
