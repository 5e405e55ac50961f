"""``deepspeed.moe.layer.MoE``: DeepSpeed's arguments, attribute names and state-dict keys
(``deepspeed_moe.gate.wg.weight``, ``deepspeed_moe.experts.deepspeed_experts.<i>.*``, ``mlp.*``,
``coefficient.*``) on zerotrain's layer (``strategies/moe/``). ``forward`` returns
``(output, l_aux, exp_counts)``.

Differences: ``use_tutel`` is accepted and unused (DeepSpeed too runs without Tutel when it is not
installed); ``enable_expert_tensor_parallelism`` is accepted and has no effect, as in DeepSpeed
without a tensor-parallel ``mpu`` (zerotrain has none); ``use_data_before_expert_parallel_=True``
(the D + E rank layout) is refused.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from .....strategies.moe import GateConfig, MoE as _MoE


class MoE(_MoE):
    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        gate = GateConfig(k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy, drop_tokens,
                          use_rts, top2_2nd_expert_sampling)
        super().__init__(hidden_size, expert, num_experts, ep_size, gate, use_residual,
                         layer_name="deepspeed_moe", list_name="deepspeed_experts")
        self.use_tutel = use_tutel
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make this layer's expert-parallel and expert-data-parallel groups (every rank calls it;
        ``deepspeed.initialize`` does, for every MoE layer of the model)."""
        if use_data_before_expert_parallel_:
            raise ValueError("set_deepspeed_parallelism: use_data_before_expert_parallel_=True; valid: False "
                             "(zerotrain lays ranks out as E + D: expert groups of consecutive ranks)")
        self.set_expert_groups()


def expert_data_groups(model: nn.Module) -> dict:
    """``id(param) -> (its expert-data-parallel group, that group's first rank)`` for every expert
    parameter of ``model``'s MoE layers, whose groups this makes (``set_deepspeed_parallelism``),
    as DeepSpeed's engine does at initialize. Dense parameters are absent: the world is theirs."""
    from .....strategies.moe import expert_groups

    out = {}
    for module in model.modules():
        if isinstance(module, MoE):
            module.set_deepspeed_parallelism()
            groups = expert_groups(module.ep_size)
            for p in module.layer.experts.parameters():
                out[id(p)] = (groups.edp_group, groups.edp_ranks[0])
    return out
