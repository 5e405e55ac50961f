"""The ResourceMonitor's mesh line (issue 45): the job's shape along the data, sequence, tensor and
pipeline axes, and the parameter bytes each rank holds, measured (``strategy.memory_report()``:
distinct storages) against the estimate (``strategies/memory/mesh.py``) from the whole model's
split by its tensor plan, taken before the strategy cuts or partitions it."""
from __future__ import annotations

import logging
import math
from typing import Any

from ...strategies.memory.mesh import ParamSplit

log = logging.getLogger(__name__)


def param_split(module: Any) -> ParamSplit | None:
    """The whole ``module``'s split by its own tensor plan (no plan: every parameter whole); None
    where it has no parameters yet (built in ``configure_model``) or its plan does not apply."""
    from ...strategies.parallel.tensor_plan import plan_split

    try:
        sharded, replicated = plan_split(module)
    except (ValueError, AttributeError):
        return None
    return ParamSplit(sharded, replicated) if sharded + replicated else None


def mesh_shape(strategy: Any) -> dict[str, int]:
    """The strategy's shape: data (replicas that see different batches), sequence, tensor, stages."""
    return {"data": strategy.data_parallel_world_size, "sequence": strategy.mesh_size("sequence"),
            "tensor": strategy.mesh_size("tensor"), "stages": getattr(strategy, "num_stages", 1)}


def estimate_param_bytes(split: ParamSplit | None, strategy: Any, shape: dict[str, int]) -> int | None:
    """This rank's working-parameter bytes by the estimate: the local elements (the cut ones / tensor,
    the whole ones, over the stages), partitioned over the replicas where the strategy partitions
    parameters (ZeRO-3), in the module's parameter dtype."""
    params = [p for p in strategy.module.parameters()] if strategy.module is not None else []
    if split is None or not params or (shape["tensor"] > 1 and not split.sharded):
        return None  # no parameters yet, or a tensor axis the model's own plan does not describe
    local = split.local(shape["tensor"], shape["stages"])
    if strategy.partitions_parameters:
        local = math.ceil(local / strategy.replica_world_size)
    return local * params[0].element_size()


def mesh_report(strategy: Any, split: ParamSplit | None) -> dict[str, Any]:
    """``{"mesh": shape, "params_measured": bytes, "params_estimate": bytes or None}`` of this rank;
    logged on global rank 0."""
    shape = mesh_shape(strategy)
    out = {"mesh": shape, "params_measured": int(strategy.memory_report()["params"]),
           "params_estimate": estimate_param_bytes(split, strategy, shape)}
    if strategy.is_global_zero:
        log.info("ResourceMonitor: %s", format_mesh_line(shape, [out]))
    return out


def format_mesh_line(shape: dict[str, int], ranks: list[dict[str, Any]]) -> str:
    """One line: the mesh and, per rank, measured (estimate) parameter bytes."""
    mesh = " x ".join(f"{axis}={n}" for axis, n in shape.items())
    per_rank = ", ".join(
        f"{r['params_measured'] / 2**20:.3f}" + ("" if r.get("params_estimate") is None
                                                 else f" ({r['params_estimate'] / 2**20:.3f})") for r in ranks)
    return f"mesh {mesh}; parameter MiB per rank, measured (estimate): {per_rank}"
