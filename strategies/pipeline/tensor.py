"""Pipeline x tensor parallelism (issue 45): every stage of every replica is a tensor-parallel
group of ``tensor_parallel`` consecutive ranks (``topology.PipelineGrid``'s innermost axis).

* **The cut.** The plan is the plain model's (``parallel.tensor_plan.plan_of``, read from the
  TrainModule before ``to_pipeline`` replaces its model: the demo GPT's ``GPT.tp_plan``, in the
  GPT's names), or one given in the pipeline's own layer names (``3.attn.c_attn``). After the
  stage is built, each of its modules whose plain name (``PipelineModule.plain_key``) or own name
  a plan pattern matches is cut over the stage's tensor group (``parallelize_tensor``), and the
  stage's forward follows the replaced layers. A stage the plan does not reach stays whole on
  every tensor rank.
* **What crosses stages.** Every module of the plan leaves its output replicated over the tensor
  group (row-parallel sums, the vocabulary-parallel embedding's sum) or vocabulary-sharded at the
  very end (the LM head: the loss is ``vocab_parallel_cross_entropy``), so tensor rank ``t`` of a
  stage sends its (replicated) activation to tensor rank ``t`` of the next and nothing else changes
  in the p2p layer; the same holds for the gradients travelling back.
* **Reductions.** A tied weight (the embedding and the LM head) is cut the same way on both stages
  (rows = vocabulary), so its tie group joins matching tensor ranks; the data-parallel group of a
  stage joins one tensor index. The replicated parameters' gradients are equal over a tensor
  group, so the global norm counts them on tensor rank 0 only (``counted_once``), the shards on
  every tensor rank.
"""
from __future__ import annotations

import re
import warnings
from typing import Any

from torch import nn

from .. import instrument
from ..parallel.tensor_plan import is_cut, parallelize_tensor, sequence_parallel_keys


def _matches(key: str, name: str) -> bool:
    """Whether plan key ``key`` (``*``: one path component) names module ``name``."""
    return re.fullmatch(r"[^.]+".join(map(re.escape, key.split("*"))), name) is not None


def stage_plan(module: nn.Module, pipe: Any, prefix: str, plan: dict) -> dict:
    """``plan`` (patterns in the plain model's names, or in the pipeline's own) for this stage's
    modules, keyed by their exact names in ``module``: what ``parallelize_tensor`` takes."""
    out: dict = {}
    for name, _ in module.named_modules():
        if not name.startswith(prefix) or name == prefix.rstrip("."):
            continue
        plain = prefix + pipe.plain_key(name[len(prefix):])
        spec = next((spec for key, spec in plan.items() if _matches(key, plain) or _matches(key, name)), None)
        if spec is not None:
            out[name] = spec
    return out


def cut_stage(module: nn.Module, pipe: Any, prefix: str, plan: dict, group: Any, size: int) -> dict[str, str]:
    """Cut this stage's planned modules over ``group`` (its tensor group) and make the stage's
    forward run the new ones; returns ``{module name: style}``. A module cut already (by the user)
    is left as is; no plan at all: a warning, every tensor rank holds the whole stage."""
    if is_cut(module):
        return {}
    if not plan:
        warnings.warn(f"tensor_parallel={size}: {type(module).__name__} declares no tp_plan (in itself or a "
                      f"submodule); nothing is cut: every tensor rank holds its whole stage")
        return {}
    sequence = sequence_parallel_keys(plan)
    if sequence:  # its stages pass activations replicated over the tensor group
        raise NotImplementedError(f"pipeline: tensor_parallel={size} with a sequence-parallel plan ({sequence[0]!r}) "
                                  f"is not built; valid: the plain tensor-parallel plan (GPT.tp_plan, "
                                  f"GPTConfig.tp_sequence_parallel=False)")
    local = stage_plan(module, pipe, prefix, plan)
    if not local:
        return {}
    before = dict(module.named_modules())
    done = parallelize_tensor(module, group, local)
    pipe.follow_replaced_layers({id(before[name]): module.get_submodule(name) for name in done})
    return done


def tensor_groups(grid: Any, rank: int, new_group: Any) -> Any:
    """Every stage's tensor group (every rank makes each, in the same order); this rank's, named
    "tensor" for the comms logger; None without a tensor axis."""
    if grid.tensor == 1:
        return None
    mine = None
    for replica in range(grid.replicas):
        for stage in range(grid.stages):
            ranks = grid.tensor_ranks(stage, replica)
            group = new_group(ranks)
            mine = group if rank in ranks else mine
    instrument.name_group(mine, "tensor")
    return mine


def counted_once(module: nn.Module, tensor_rank: int) -> set[int]:
    """``id``s of the parameters the global norm does not count on this rank: the replicated
    ones (equal gradients over the tensor group) everywhere but on tensor rank 0."""
    if tensor_rank == 0:
        return set()
    return {id(p) for p in module.parameters() if not hasattr(p, "tensor_parallel")}
