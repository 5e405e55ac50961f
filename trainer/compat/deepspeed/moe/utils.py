"""``deepspeed.moe.utils``: telling expert parameters (marked ``allreduce = False`` with the
``group_name`` of their expert group by ``deepspeed.moe.layer.MoE``) from dense ones, and the
optimizer groups DeepSpeed builds from them."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether ``model`` has an MoE layer, the first one's ``num_experts``; 0 without)."""
    from .layer import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: Any) -> bool:
    """Whether ``param`` belongs to an expert (DeepSpeed marks those ``allreduce=False``)."""
    return getattr(param, "allreduce", True) is False


def split_params_into_shared_and_expert_params(params: Any) -> tuple[list, list]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group: Any) -> tuple[list, list]:
    """(shared, expert) gradients of ``group``'s parameters, in the parameters' dtype."""
    with_grad = [p for p in group if p.grad is not None]
    return ([p.grad.to(p.dtype) for p in with_grad if not is_moe_param(p)],
            [p.grad.to(p.dtype) for p in with_grad if is_moe_param(p)])


def _as_list(param_groups: Any) -> list:
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    if not isinstance(param_groups, list):
        raise ValueError(f"param_groups={type(param_groups).__name__}; valid: a dict, or a list or tuple of dicts")
    return param_groups


def _chunks(params: list, max_size: Any) -> list[list]:
    """``params`` cut in order into runs of at most ``max_size`` elements (a larger one alone)."""
    runs, run, size = [], [], 0
    for p in params:
        n = getattr(p, "ds_numel", None) or p.numel()
        if run and size + n > max_size:
            runs.append(run)
            run, size = [], 0
        run.append(p)
        size += n
    return runs + ([run] if run else [])


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = 178956971) -> list:
    """DeepSpeed's split: each group keeps its dense parameters, and its expert parameters move,
    per expert group name, into new groups appended after all the originals (a copy of the
    group's options with ``name`` = the expert group's, ``moe=True``), cut into groups of at most
    ``max_group_size`` elements (None: uncut). A dict comes back as a list of one."""
    param_groups = _as_list(param_groups)
    for group in param_groups:
        group["params"] = list(group["params"])  # a generator would be spent by the first pass
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe: dict = defaultdict(dict)
    for i, group in enumerate(param_groups):
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts and "name" not in group:
            raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: param_groups[{i}] has expert "
                             "parameters and no 'name'; valid: every group given a 'name' (DeepSpeed's key)")
        for name in names:
            moe[i][name] = {**group, "name": name, "moe": True,
                            "params": [p for p in experts if p.group_name == name]}
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
    for i in range(len(param_groups)):
        for new in moe[i].values():
            if max_group_size is None:
                param_groups.append(new)
            else:
                param_groups.extend({**new, "params": run} for run in _chunks(new["params"], max_group_size))
    return param_groups


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)
