"""Mixture of experts with expert parallelism (issue 46): DeepSpeed-MoE's layer.

``gate`` (top-1/top-2 routing, capacity, noise, the load-balancing loss), ``dispatch`` (the slot
buffer, the autograd all-to-all), ``experts`` (a rank's local experts, their parameters marked),
``groups`` (expert-parallel and expert-data-parallel process groups), ``layer`` (``MOELayer`` and
``MoE``, returning ``(output, l_aux, exp_counts)``), ``grads`` (expert gradients summed over
their expert-data-parallel group: DDP's, ``strategies/ddp.py``), ``hf`` (Hugging Face MoE models'
own experts modules placed by expert parallelism: ``use_expert_parallel``), ``estimate`` (the
dense/expert split and each rank's share).

May import: strategies.instrument, strategies.memory.
"""
from .gate import GateConfig, Routes, TopKGate
from .groups import ExpertGroups, expert_groups, group_name
from .hf import find_experts, use_expert_parallel
from .layer import MOELayer, MoE

__all__ = ["ExpertGroups", "GateConfig", "MOELayer", "MoE", "Routes", "TopKGate", "expert_groups", "find_experts",
           "group_name", "use_expert_parallel"]
