"""Expert parameters (``strategies/moe/``) in ZeRO-1/2: which process group partitions a flat group.

A param group is of one kind: dense parameters, replicated over the world, or the expert
parameters of one expert group (``group_name = "ep_size_<n>"``), replicated only over their
expert-data-parallel (EDP) group of ``world / n`` ranks. DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer`` builds such groups; a group mixing the
kinds is refused (splitting it here would add param groups behind an LR scheduler already built
on the user's). An expert flat group is partitioned, reduced and gathered over its EDP group;
its gradients are still divided by the whole world (``reduction.py``), so they equal DDP's with
every expert on every rank.

The gradient norm: ranks at different places of an expert-parallel group hold different experts
at the same place of their flat groups, so each expert parameter gets one entry of the norm
vector per expert-parallel place (:func:`expert_norm_entries`); the rank at that place fills it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..moe.groups import ExpertGroups, ep_size_of, expert_groups
from .comm.grad_norm import ParamNorm, plan_param
from .layout import GroupLayout


@dataclass(frozen=True)
class Partitioning:
    """Who partitions one flat group: ``group`` (None: the default), this rank's index in it and
    its size; ``experts``: the expert groups for an expert flat group, None for a dense one."""

    group: Any
    rank: int
    size: int
    experts: ExpertGroups | None = None


def group_kind(index: int, params: Sequence[nn.Parameter], names: dict[int, str]) -> str | None:
    """The ``group_name`` of param group ``index``'s experts, None for a dense group; ValueError
    (one line) for a group mixing dense and expert parameters or two expert groups (experts of
    ``ep_size=1`` count as dense)."""
    kinds = {_kind(p) for p in params}
    if len(kinds) <= 1:
        return next(iter(kinds), None)
    dense = [names[id(p)] for p in params if _kind(p) is None][:1]
    expert = [names[id(p)] for p in params if _kind(p) is not None][:1]
    raise ValueError(f"optimizer param group {index} mixes {'dense parameter ' + repr(dense[0]) if dense else ''}"
                     f"{' and ' if dense else ''}expert parameters of {sorted(k for k in kinds if k)} (e.g. "
                     f"{expert[0]!r}); ZeRO partitions each kind over its own group: valid: one kind per param "
                     "group, as split_params_into_different_moe_groups_for_optimizer(param_groups) (from "
                     "zerotrain.deepspeed.moe.utils) builds them")


def _kind(p: nn.Parameter) -> str | None:
    """An expert parameter's group name; None for a dense one, or an expert of ``ep_size=1``
    (replicated over the world as a dense one)."""
    if getattr(p, "allreduce", True) is not False:
        return None
    name = getattr(p, "group_name", None)
    return None if name == "ep_size_1" else name


def refuse_frozen_experts(module: nn.Module, owner: str) -> None:
    """Frozen expert parameters (``ep_size`` > 1) would be treated as replicated extras: broadcast
    from rank 0 over every expert-parallel place and saved under local names. Refused, the same on
    every rank, before any collective."""
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad and _kind(p) is not None]
    if frozen:
        raise ValueError(f"{owner}: frozen expert-parallel parameter {frozen[0]!r} ({_kind(module.get_parameter(frozen[0]))}) "
                         "is not supported: each expert-parallel rank holds other experts; valid: train the experts "
                         "(requires_grad=True), or ep_size=1")


def is_expert_group(params: Sequence[nn.Parameter]) -> bool:
    """Whether a flat group's parameters are experts' (of ``ep_size`` > 1; a group is one kind)."""
    return bool(params) and _kind(params[0]) is not None


def partitioning(kind: str | None, replica_group: Any, replica_rank: int, replicas: int) -> Partitioning:
    """Who partitions a flat group of ``kind`` (:func:`group_kind`): dense ones the replicas (the
    world without sequence/tensor axes); experts their EDP group. Collective the first time an
    expert group is asked for (``moe.groups.expert_groups``)."""
    if kind is None:
        return Partitioning(replica_group, replica_rank, replicas)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if replicas != world:
        raise ValueError(f"expert parameters ({kind}) with {world // replicas} ranks per replica (a tensor "
                         "axis): not built; valid: expert parallelism over data-parallel ranks only")
    groups = expert_groups(ep_size_of(kind))
    me = dist.get_rank() if dist.is_initialized() else 0
    return Partitioning(groups.edp_group, groups.edp_ranks.index(me), len(groups.edp_ranks), groups)


def expert_norm_entries(slot: int, params: Sequence[nn.Parameter], layout: GroupLayout,
                        part: Partitioning) -> list[ParamNorm]:
    """The norm entries of an expert flat group's parameters: for each, one per place of the
    expert-parallel group (the experts held there); this rank plans its own place's (its
    partition of its EDP group, boundary parameters assembled over the EDP group, written by
    the EDP group's first rank) and leaves the others to their holders."""
    assert part.experts is not None
    places, here = len(part.experts.ep_ranks), part.experts.ep_ranks.index(_global(part))
    out = []
    for i, p in enumerate(params):
        for place in range(places):
            if place == here:
                own = plan_param(slot, p.shape, layout, i, part.rank, lambda s: (slot, s))
                out.append(ParamNorm(own.group, own.shape, own.numel, own.whole, own.mine, part.group,
                                     part.rank == 0))
            else:
                out.append(ParamNorm(slot, torch.Size(p.shape), p.numel(), True, ()))
    return out


def _global(part: Partitioning) -> int:
    assert part.experts is not None
    return part.experts.edp_ranks[part.rank]


def global_names(module: nn.Module) -> dict[str, str]:
    """``local name -> global name`` of every expert parameter of ``ep_size`` > 1 in ``module``: a
    rank at place ``i`` of its expert-parallel group holds experts ``i * local ... (i + 1) * local - 1``,
    so its ``<layer>.<list>.<j>.*`` is saved as ``<layer>.<list>.<i * local + j>.*`` and a load at
    another ``ep_size`` reads the experts it holds by their global names (each EDP group's
    partitions together hold its place's experts once)."""
    from ..moe.experts import Experts

    out: dict[str, str] = {}
    for prefix, mod in module.named_modules():
        if not isinstance(mod, Experts):
            continue
        kinds = {_kind(p) for p in mod.parameters()} - {None}
        if not kinds:
            continue
        groups = expert_groups(ep_size_of(kinds.pop()))
        place = groups.ep_ranks.index(dist.get_rank() if dist.is_initialized() else 0)
        head = f"{prefix}.{mod.list_name}." if prefix else f"{mod.list_name}."
        for j, expert in enumerate(mod.local):
            for name, _ in expert.named_parameters():
                out[f"{head}{j}.{name}"] = f"{head}{place * mod.num_local + j}.{name}"
    return out
