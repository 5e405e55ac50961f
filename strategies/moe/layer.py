"""The mixture-of-experts layer: gate -> slot buffer -> all-to-all -> local experts -> all-to-all
-> weighted combine; ``forward`` returns ``(output, l_aux, exp_counts)`` as DeepSpeed's does.

``ep_size`` ranks share the ``num_experts`` experts, ``num_experts / ep_size`` each (rank i of an
expert-parallel group holds experts ``i * local ... (i + 1) * local - 1``). The groups are made at
the first forward (or by ``set_expert_groups``), by every rank. ``use_residual``: the Residual MoE,
``output * c0 + mlp(x) * c1`` with ``c = softmax(coefficient(x))`` and ``mlp`` the expert module
given (shared with no expert: the experts are copies).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch
from .experts import Experts
from .gate import GateConfig, TopKGate
from .groups import expert_groups, group_name


class MOELayer(torch.nn.Module):
    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int) -> None:
        super().__init__()
        self.gate, self.experts, self.ep_size = gate, experts, ep_size
        self.num_local_experts = experts.num_local
        self.ep_group = None
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def set_ep_group(self, group) -> None:
        self.ep_group = self.gate.ep_group = group

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            self.set_ep_group(expert_groups(self.ep_size).ep_group)
        model = x.shape[-1]
        tokens = x.reshape(-1, model)
        routes = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        experts = self.ep_size * self.num_local_experts
        where = dispatch.slots(routes)
        buffer = dispatch.encode(tokens, where, experts, routes.capacity)
        if self.ep_size > 1:
            buffer = dispatch.all_to_all(buffer, self.ep_group)
        out = self.experts(buffer.reshape(self.ep_size, self.num_local_experts, -1, model))
        out = out.reshape(experts, -1, model)
        if self.ep_size > 1:
            out = dispatch.all_to_all(out, self.ep_group)
        return dispatch.decode(out, where, routes.weights).reshape(x.shape)


class MoE(torch.nn.Module):
    """``MoE(hidden_size, expert, num_experts, ep_size, gate=GateConfig(k=2, ...))``: DeepSpeed's layer,
    its gate options in one :class:`GateConfig` (``zerotrain.deepspeed.moe.layer.MoE`` takes them
    flat, as DeepSpeed). ``layer_name``/``list_name``: the attribute names of the layer and of the
    expert list (DeepSpeed's face passes ``deepspeed_moe``/``deepspeed_experts`` so its state dict
    keys match)."""

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 gate: GateConfig = GateConfig(), use_residual: bool = False, *, layer_name: str = "moe",
                 list_name: str = "experts") -> None:
        super().__init__()
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size={ep_size}; valid: a divisor of num_experts={num_experts}")
        self.num_experts, self.ep_size, self.use_residual = num_experts, ep_size, use_residual
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = group_name(ep_size)
        self.layer_name = layer_name
        experts = Experts(expert, self.num_local_experts, self.expert_group_name, list_name)
        setattr(self, layer_name, MOELayer(TopKGate(hidden_size, num_experts, gate), experts, ep_size))
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    @property
    def layer(self) -> MOELayer:
        return getattr(self, self.layer_name)

    def set_expert_groups(self) -> None:
        """Make (or find) this layer's expert groups now; every rank must call it."""
        self.layer.set_ep_group(expert_groups(self.ep_size).ep_group if self.ep_size > 1 else None)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        out = self.layer(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + dense * coef[..., 1:]
        return out, self.layer.l_aux, self.layer.exp_counts
