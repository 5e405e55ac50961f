"""Mixture of experts with expert parallelism (issue 46): DeepSpeed-MoE's layer.

``gate`` (top-1/top-2 routing, capacity, noise, the load-balancing loss), ``dispatch`` (the slot
buffer, the autograd all-to-all), ``experts`` (a rank's local experts, their parameters marked),
``groups`` (expert-parallel and expert-data-parallel process groups), ``layer`` (``MOELayer`` and
``MoE``, returning ``(output, l_aux, exp_counts)``), ``grads`` (expert gradients summed over
their expert-data-parallel group: DDP's, ``strategies/ddp.py``).

May import: strategies.instrument.
"""
from .gate import GateConfig, Routes, TopKGate
from .groups import ExpertGroups, expert_groups, group_name
from .layer import MOELayer, MoE

__all__ = ["ExpertGroups", "GateConfig", "MOELayer", "MoE", "Routes", "TopKGate", "expert_groups", "group_name"]
