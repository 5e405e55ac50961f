"""DeepSpeed's AutoTP training (``"tensor_parallel": {"autotp_size": n}``) on zerotrain's tensor
parallelism: ``initialize`` cuts the model over the strategy's tensor group before it builds the
optimizer (as DeepSpeed's engine does), so the optimizer steps each rank's shards.

The plan is the model's Hugging Face ``tp_plan`` as DeepSpeed 0.19.8 applies it: every entry, except
that ``embedding_rowwise`` is applied only where the output head (``lm_head`` / ``embed_out``) is
tied to the embedding; an untied embedding stays whole on every rank, as DeepSpeed leaves it. A
model without a ``tp_plan`` is refused (DeepSpeed would fall back to its heuristic AutoTP, which
zerotrain does not have).

``sequence_parallel_of``: ALST's ``mpu`` (Ulysses sequence parallelism) as the strategy's
``sequence_parallel``.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
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


def sequence_parallel_of(mpu: Any) -> int:
    """``initialize(mpu=...)``: the sequence-parallel size of ALST's ``mpu`` (what
    ``UlyssesSPAttentionHF.register_with_transformers`` returns; 1 for None). DeepSpeed 0.19.8 then
    runs ZeRO over every rank (data x sequence) and takes the data-parallel size as world / sp; the
    strategy's ``sequence_parallel`` is that mesh. Its sequence groups must be consecutive ranks
    (zerotrain's mesh, and DeepSpeed's own ``parallel_state_sp``). Any other ``mpu`` (Megatron's
    tensor / pipeline groups) is refused."""
    if mpu is None:
        return 1
    if not hasattr(mpu, "initialize_sequence_parallel") or not hasattr(mpu, "get_sequence_parallel_group"):
        raise ConfigError(f"initialize: mpu={getattr(mpu, '__name__', type(mpu).__name__)}; valid: None, or ALST's mpu "
                          "(UlyssesSPAttentionHF.register_with_transformers; zerotrain has no Megatron "
                          "tensor/pipeline mpu)")
    size = int(mpu.get_sequence_parallel_world_size())
    ranks = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
    first = dist.get_rank() // size * size
    if ranks != list(range(first, first + size)):
        raise ConfigError(f"initialize: mpu's sequence group {ranks} on rank {dist.get_rank()}; valid: "
                          f"consecutive ranks {list(range(first, first + size))} (groups of sequence_parallel_size)")
    return size
