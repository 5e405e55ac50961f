"""``deepspeed.moe.utils``: the helpers DeepSpeed scripts call on their optimizer's parameter
groups. zerotrain has no mixture-of-experts layers, so no parameter is an expert's: the groups
pass through as they are (DeepSpeed's result for a model without experts)."""
from __future__ import annotations

from typing import Any


def is_moe_param(param: Any) -> bool:
    """Whether ``param`` belongs to an expert (DeepSpeed marks those ``allreduce=False``)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = 178956971) -> Any:
    """DeepSpeed splits each group's expert parameters into groups of their own; without experts
    the groups come back unchanged (a single dict comes back as a list of one, as DeepSpeed does)."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups={type(param_groups).__name__}; valid: a dict, or a list or tuple of dicts")
    for group in param_groups:
        group["params"] = list(group["params"])  # a generator would be spent by the check below
    experts = [p for g in param_groups for p in g["params"] if is_moe_param(p)]
    if experts:
        raise ValueError("split_params_into_different_moe_groups_for_optimizer: expert parameters (allreduce=False) "
                         "found; valid: a model without mixture-of-experts layers (zerotrain has none)")
    return param_groups


def split_params_grads_into_shared_and_expert_params(group: Any) -> tuple[list, list]:
    """(shared, expert) gradients of ``group``'s parameters; without experts all are shared."""
    return [p.grad for p in group if p.grad is not None], []
