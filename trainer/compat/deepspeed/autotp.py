"""DeepSpeed's AutoTP training (``"tensor_parallel": {"autotp_size": n}``) on zerotrain's tensor
parallelism: ``initialize`` cuts the model over the strategy's tensor group before it builds the
optimizer (as DeepSpeed's engine does), so the optimizer steps each rank's shards.

The plan is the model's Hugging Face ``tp_plan`` as DeepSpeed 0.19.8 applies it: every entry, except
that ``embedding_rowwise`` is applied only where the output head (``lm_head`` / ``embed_out``) is
tied to the embedding; an untied embedding stays whole on every rank, as DeepSpeed leaves it. A
model without a ``tp_plan`` (GPT-2) is cut by the plan found by name and shape
(``strategies/parallel/tensor_auto.py``: column-parallel projections reading the hidden size, the
last one writing it row-parallel, a fused ``c_attn`` cut per head group of q, k and v; Conv1D in its
own layout). DeepSpeed 0.19.8 falls back to its heuristic AutoTP there, which refuses GPT-2
(``AutoTP not supported for model``), so that case is zerotrain's own, checked against one process.

``check_inputs_once``: the model's first forward compares its inputs across the tensor group, as
DeepSpeed's engine does (the ranks of a tensor group compute one replica's batch together; a loader
sharded by global rank instead of data-parallel rank would train on mismatched halves silently).

``sequence_parallel_of``: ALST's ``mpu`` (Ulysses sequence parallelism) as the strategy's
``sequence_parallel``.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from ....strategies.parallel import parallelize_tensor, plan_of
from ....strategies.parallel.tensor_auto import parallelize_by_shape


def _tied_head(model: nn.Module) -> bool:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return any(isinstance(m, nn.Linear) and name.rpartition(".")[2] in ("lm_head", "embed_out")
               and id(m.weight) in embeddings for name, m in model.named_modules())


def autotp_plan(model: nn.Module) -> dict:
    """The model's own plan as DeepSpeed 0.19.8's AutoTP follows it (see the module's doc); ``{}``
    for a model without one."""
    plan = plan_of(model)
    if _tied_head(model):
        return plan
    return {k: v for k, v in plan.items() if v != "embedding_rowwise"}


def cut_for_autotp(strategy, model: nn.Module) -> None:
    """Cut ``model`` over the strategy's tensor group (nothing without a tensor axis): by its own
    plan, else by the plan found by name and shape."""
    if strategy.mesh_size("tensor") == 1:
        return
    group, plan = strategy.mesh_group("tensor"), autotp_plan(model)
    try:
        parallelize_tensor(model, group, plan) if plan else parallelize_by_shape(model, group)
    except ValueError as e:
        if plan:
            raise
        raise ConfigError(f"tensor_parallel.autotp_size: {type(model).__name__} declares no tp_plan; {e}") from None


def _input_tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value.detach().cpu()
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _input_tensors(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _input_tensors(v, f"{path}[{i}]")


def check_inputs_once(strategy, model: nn.Module) -> None:
    """With a tensor axis: a forward pre-hook on ``model`` that, at its first call (then it is
    removed), compares the call's tensors with the tensor group's first rank's and raises on every
    rank of the group if any differs (collective over the tensor group)."""
    if strategy.mesh_size("tensor") <= 1:
        return
    group = strategy.mesh_group("tensor")

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        handle.remove()
        mine = dict(_input_tensors(args, "args")) | dict(_input_tensors(kwargs, "kwargs"))
        first = [mine]
        dist.broadcast_object_list(first, src=dist.get_global_rank(group, 0), group=group)
        differ = sorted(k for k in mine.keys() | first[0].keys()
                        if k not in mine or k not in first[0] or not torch.equal(mine[k], first[0][k]))
        flag = torch.tensor([int(bool(differ))])
        dist.all_reduce(flag, group=group)
        if flag.item():
            ranks = dist.get_process_group_ranks(group)
            raise ConfigError(f"forward: the inputs differ within the tensor-parallel group {ranks} "
                              f"({', '.join(differ) or 'on another rank'} on rank {dist.get_rank()}); valid: the "
                              f"same batch on every rank of a tensor group (shard the data by the data-parallel "
                              f"rank, as DeepSpeed's AutoTP requires)")

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


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
