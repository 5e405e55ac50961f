"""Expert gradients in a data-parallel strategy: which parameters are experts' and their reduction.

An expert's gradient after backward already sums the tokens of every rank of its expert-parallel
group (the all-to-all's backward); it is summed over its expert-data-parallel group and divided
by the whole world, so it equals the average DDP takes with every expert on every rank. One
flat all-reduce per expert group (by ``group_name``), reported through ``instrument``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..instrument import blocking
from .groups import ep_size_of, expert_groups


def expert_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """``name -> parameter`` of ``module``'s expert parameters (marked ``allreduce = False``)."""
    return {n: p for n, p in module.named_parameters() if getattr(p, "allreduce", True) is False}


def reduce_expert_grads(params: list[nn.Parameter], world: int) -> None:
    """Sum each expert gradient over its expert-data-parallel group, divided by ``world``."""
    by_group: dict[str, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:  # no token reached it here: its peers' sums still come, and every rank joins
            p.grad = torch.zeros_like(p)
        by_group.setdefault(p.group_name, []).append(p)
    for name in sorted(by_group):
        grads = [p.grad for p in by_group[name]]
        groups = expert_groups(ep_size_of(name))
        if len(groups.edp_ranks) > 1:
            flat = _flatten_dense_tensors(grads)
            with blocking("all_reduce", flat, groups.edp_group):
                dist.all_reduce(flat, group=groups.edp_group)
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)
        torch._foreach_div_(grads, float(world))


def expert_norm_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """The sum of squares of every expert gradient of the model (after ``reduce_expert_grads``):
    this rank's experts' summed over their expert-parallel group, which holds each expert once."""
    by_group: dict[str, list[torch.Tensor]] = {}
    for p in params:  # a gradient-less expert counts as zeros, so every rank joins its group's sum
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        by_group.setdefault(p.group_name, []).append(grad.detach().float())
    total = torch.zeros(())
    for name in sorted(by_group):
        part = torch.nn.utils.get_total_norm(by_group[name], norm_type=2.0) ** 2
        groups = expert_groups(ep_size_of(name))
        if len(groups.ep_ranks) > 1:
            with blocking("all_reduce", part, groups.ep_group):
                dist.all_reduce(part, group=groups.ep_group)
        total = total + part
    return total
