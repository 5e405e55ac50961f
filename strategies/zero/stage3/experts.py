"""ZeRO-3's expert units (issue 46; the plan: strategies/README.md, "Expert parameters in DDP and
ZeRO", item 4).

``unit_plan`` gives expert parameters (moe/'s marks) units of their own, one kind each. Such a unit
lives on its expert-data-parallel (EDP) group, the ranks holding the same experts: its layout is
partitioned over that group's size, its rank is this rank's index there, its gathers, reductions
and refreshes run over that group (with ``ep_size`` = world the group is this rank alone: nothing
is ever gathered), and its summed gradients are divided by the whole world, as the dense ones
are, so both equal the average with every expert on every rank. Its values at set-up are its EDP
group's first rank's (each expert-parallel rank built different experts).

The gradient norm: every expert element lies in exactly one rank's partition of one EDP group, so
the experts' squared norm is one world all-reduce of each rank's squared partitions; it joins the
dense parameters' norm (``grad_norm.py``, over the dense parameters only) as a sum of squares.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.collectives import all_reduce_sum, global_rank


@dataclass(frozen=True)
class UnitGroup:
    """Where a unit's shards live: ``size`` ranks of ``group`` (None: the strategy's), this rank
    being ``rank`` there, values from global rank ``source``."""

    group: object
    size: int
    rank: int
    source: int


def unit_group(kind: str | None, world: int, rank: int, group: object) -> UnitGroup:
    """Dense (``kind`` None): the strategy's group; an expert kind: its EDP group."""
    if kind is None:
        return UnitGroup(group, world, rank, global_rank(group, 0))
    from ...moe.groups import expert_groups  # the groups are made collectively at the first call

    if not kind.startswith("ep_size_") or not kind[len("ep_size_"):].isdigit():
        raise ValueError(f"zero3: expert group_name={kind!r}; valid: 'ep_size_<n>' (DeepSpeed's names)")
    groups = expert_groups(int(kind[len("ep_size_"):]))
    edp = list(groups.edp_ranks)
    return UnitGroup(groups.edp_group, len(edp), edp.index(rank), edp[0])


def refuse_with_experts(units: list, what: str, valid: str) -> None:
    """ValueError (one line) naming an expert unit where ``what`` does not handle them yet."""
    held = [u.name for u in units if u.has_own_group]
    if held:
        raise ValueError(f"zero3: {what} with expert-parallel units ({held[0]!r}, ...) is not built yet "
                         f"(issue 46); valid: {valid}")


def experts_norm_sq(units: list, device: torch.device, complete, group: object = None) -> torch.Tensor:
    """Collective over the world: the sum of squares of every expert gradient (the reduced
    partitions, each expert element counted once)."""
    part = torch.zeros((), dtype=torch.float32, device=device)
    for u in units:
        if u.has_own_group:
            part += u.grad.detach().float().pow(2).sum()
    complete(all_reduce_sum(part, group), part, "grad norm (experts)")
    return part
