"""Expert parallelism for Hugging Face MoE models, their modules unchanged (issue 46).

The rule that finds a model's experts (no per-model table): an *experts module* is one with an
integer ``num_experts`` whose own parameters all stack the experts along their first dimension
(``shape[0] == num_experts``), one at least a matrix per expert (3 dimensions: a router's
[E, H] weight is not an experts module), and whose children hold no parameters. transformers 5's Mixtral,
Qwen2-MoE and OLMoE experts containers are such modules (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]), called as ``experts(hidden_states [N, H], top_k_index [N, K],
top_k_weights [N, K])`` by their sparse MoE block, after its router (which stays dense).

:func:`use_expert_parallel` places them: rank i of an expert-parallel group of ``ep_size`` keeps
experts ``[i * E / ep, (i + 1) * E / ep)`` (each parameter cut to that slice, in place, marked as
an expert's, ``experts.mark_expert``: DDP and ZeRO-3 then reduce it over its expert-data-parallel
group), and the module's ``forward`` is wrapped on the instance: each route (token, k) travels by
an all-to-all of variable size to the rank holding its expert, the module's own forward runs
there on the routes it received (their expert renumbered locally, weight 1), the outputs travel
back by the reverse all-to-all and each token's routes are summed with their router weights here.
That is exactly the module's own computation (each route's expert output times its weight, summed
per token; two routes add in either order to the same fp32 value), with autograd through both
exchanges (the backward of an all-to-all is the reverse all-to-all of the gradients).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..instrument import blocking
from .experts import mark_expert
from .groups import expert_groups, group_name


def is_experts_module(module: nn.Module) -> bool:
    """The module docstring's rule."""
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    if not isinstance(count, int) or count < 1 or not own:
        return False
    if any(True for child in module.children() for _ in child.parameters()):
        return False
    return all(p.dim() >= 1 and p.shape[0] == count for p in own) and any(p.dim() >= 3 for p in own)


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every experts module of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with blocking("all_to_all", x, group):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, *ctx.splits, ctx.group), None, None, None


class _Placed:
    """The wrapped ``forward`` of one experts module (see the module docstring)."""

    def __init__(self, module: nn.Module, ep_size: int, first: int, local: int) -> None:
        self.inner = type(module).forward.__get__(module)
        self.ep_size, self.first, self.local = ep_size, first, local
        self.group = None

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.group is None:
            self.group = expert_groups(self.ep_size).ep_group
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1).long()
        dest = torch.div(experts, self.local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        source = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)[order]
        send = torch.bincount(dest, minlength=self.ep_size)
        recv = torch.empty_like(send)
        with blocking("all_to_all", send, self.group):
            dist.all_to_all_single(recv, send, group=self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        x = _AllToAllV.apply(hidden_states[source], recv_splits, send_splits, self.group)
        local_index = _exchange(experts[order] - dest[order] * self.local, recv_splits, send_splits, self.group)
        ones = torch.ones(x.shape[0], 1, dtype=top_k_weights.dtype, device=x.device)
        out = self.inner(x, local_index.reshape(-1, 1), ones)
        back = _AllToAllV.apply(out, send_splits, recv_splits, self.group)
        weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, source, weighted.to(hidden_states.dtype))


def use_expert_parallel(model: nn.Module, ep_size: int) -> list[str]:
    """Collective (every rank, the same model structure): place every experts module of ``model``
    over expert-parallel groups of ``ep_size`` ranks (the module docstring); returns their names.
    Call it after the process group exists and before a strategy sets the model up."""
    found = find_experts(model)
    if not found:
        raise ValueError(f"use_expert_parallel: {type(model).__name__} has no experts module (a module with an "
                         "integer num_experts whose own parameters stack the experts along dim 0); valid: a "
                         "Hugging Face MoE model such as Mixtral, Qwen2-MoE or OLMoE")
    for name, m in found:
        if m.num_experts % ep_size:
            raise ValueError(f"use_expert_parallel: ep_size={ep_size} does not divide {name}.num_experts="
                             f"{m.num_experts}; valid: a divisor of it")
    groups = expert_groups(ep_size)  # collective at the first call
    rank = dist.get_rank() if dist.is_initialized() else 0
    place = list(groups.ep_ranks).index(rank)
    for name, m in found:
        local = m.num_experts // ep_size
        first = place * local
        with torch.no_grad():
            for p in m.parameters(recurse=False):
                p.data = p.data[first:first + local].clone()  # in place: the Parameter object stays
                mark_expert(p, group_name(ep_size))
        m.num_experts = local
        if ep_size > 1:
            m.forward = _Placed(m, ep_size, first, local)
    return [name for name, _ in found]
