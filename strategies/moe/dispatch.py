"""Moving tokens to experts and back: the slot buffer and the all-to-all.

``encode`` copies each kept route's token into its expert's slot of an [experts, capacity, model]
buffer (empty slots hold zeros); ``decode`` reads each route's slot back and sums the routes
weighted by the gate. Both are one ``index_select`` over a buffer padded by one zero row, where
dropped routes point, so gradients flow to exactly the routes that were kept.

``all_to_all`` sends the buffer's i-th block of experts to rank i of the expert-parallel group and
receives every rank's tokens for the local experts; its backward is the same exchange of the
gradients. The bytes it moves are reported to the CommsLogger/ResourceMonitor (``instrument``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..instrument import blocking


def slots(routes) -> torch.Tensor:
    """[k, tokens] flat slot of each route in the [experts * capacity] buffer; dropped routes get
    the extra slot ``experts * capacity``."""
    experts = int(routes.exp_counts.numel())
    flat = routes.indices.long() * routes.capacity + routes.locations.long()
    return torch.where(routes.indices >= 0, flat, torch.full_like(flat, experts * routes.capacity))


def encode(tokens: torch.Tensor, where: torch.Tensor, experts: int, capacity: int) -> torch.Tensor:
    """[tokens, model] -> [experts, capacity, model]."""
    n, model = tokens.shape
    source = torch.full((experts * capacity + 1,), n, dtype=torch.long, device=tokens.device)
    source.scatter_(0, where.reshape(-1), torch.arange(n, device=tokens.device).expand_as(where).reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, model)])
    return padded.index_select(0, source[:-1]).view(experts, capacity, model)


def decode(buffer: torch.Tensor, where: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[experts, capacity, model] -> [tokens, model], the routes summed with their weights."""
    model = buffer.shape[-1]
    padded = torch.cat([buffer.reshape(-1, model), buffer.new_zeros(1, model)])
    routed = padded.index_select(0, where.reshape(-1)).view(*where.shape, model)
    return (routed * weights.unsqueeze(-1)).sum(0).to(buffer.dtype)


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    with blocking("all_to_all", x, group):
        dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal blocks of ``x``'s first dimension exchanged over ``group``, with autograd."""
    return _AllToAll.apply(x, group)
