"""DeepSpeed's AutoTP training (``"tensor_parallel": {"autotp_size": n}``) on zerotrain's tensor
parallelism: ``initialize`` cuts the model over the strategy's tensor group before it builds the
optimizer (as DeepSpeed's engine does), so the optimizer steps each rank's shards.

The plan is the model's Hugging Face ``tp_plan`` as DeepSpeed 0.19.8 applies it: every entry, except
that ``embedding_rowwise`` is applied only where the output head (``lm_head`` / ``embed_out``) is
tied to the embedding; an untied embedding stays whole on every rank, as DeepSpeed leaves it. A
model without a ``tp_plan`` is refused (DeepSpeed would fall back to its heuristic AutoTP, which
zerotrain does not have).
"""
from __future__ import annotations

from torch import nn

from ...errors import ConfigError
from ....strategies.parallel import parallelize_tensor, plan_of


def _tied_head(model: nn.Module) -> bool:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return any(isinstance(m, nn.Linear) and name.rpartition(".")[2] in ("lm_head", "embed_out")
               and id(m.weight) in embeddings for name, m in model.named_modules())


def autotp_plan(model: nn.Module) -> dict:
    """The plan DeepSpeed 0.19.8's AutoTP follows for ``model`` (see the module's doc)."""
    plan = plan_of(model)
    if not plan:
        raise ConfigError(f"tensor_parallel.autotp_size: {type(model).__name__} has no Hugging Face tp_plan; zerotrain's "
                          f"AutoTP follows a model's own plan (DeepSpeed's heuristic AutoTP is not implemented)")
    if _tied_head(model):
        return plan
    return {k: v for k, v in plan.items() if v != "embedding_rowwise"}


def cut_for_autotp(strategy, model: nn.Module) -> None:
    """Cut ``model`` over the strategy's tensor group (nothing without a tensor axis)."""
    if strategy.mesh_size("tensor") > 1:
        parallelize_tensor(model, strategy.mesh_group("tensor"), autotp_plan(model))
