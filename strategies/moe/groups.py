"""Process groups of expert parallelism (DeepSpeed's layout, without tensor or pipeline parallelism).

With ``world`` ranks and ``ep_size``: expert-parallel groups are consecutive ranks
``[0..ep-1], [ep..2ep-1], ...`` (tokens travel inside one by all-to-all; together its members hold
every expert once); expert-data-parallel groups are the strided ``[i, i+ep, i+2ep, ...]`` (the
replicas of the same experts, over which expert gradients are reduced). Dense parameters stay
replicated over the whole world. Groups are made once per ``ep_size``, by every rank in the same
order, as ``torch.distributed.new_group`` requires.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ExpertGroups:
    ep_size: int
    ep_group: Any
    ep_ranks: tuple
    edp_group: Any
    edp_ranks: tuple

    @property
    def name(self) -> str:
        return group_name(self.ep_size)


_MADE: dict[int, ExpertGroups] = {}


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert group of ``ep_size`` (``param.group_name``)."""
    return f"ep_size_{ep_size}"


def ep_size_of(name: str) -> int:
    """The ``ep_size`` of an expert group named by :func:`group_name`; ValueError for another name."""
    if not (isinstance(name, str) and name.startswith("ep_size_") and name[len("ep_size_"):].isdigit()):
        raise ValueError(f"expert group_name={name!r}; valid: 'ep_size_<n>' (DeepSpeed's names)")
    return int(name[len("ep_size_"):])


def layout(world: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups), pure."""
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size}; valid: a divisor of the world size {world}")
    ep = [list(range(s, s + ep_size)) for s in range(0, world, ep_size)]
    edp = [list(range(i, world, ep_size)) for i in range(ep_size)]
    return ep, edp


def expert_groups(ep_size: int) -> ExpertGroups:
    """This rank's groups for ``ep_size`` (made at the first call; every rank must call it)."""
    if ep_size in _MADE:
        return _MADE[ep_size]
    if not dist.is_initialized():
        if ep_size != 1:
            raise ValueError(f"ep_size={ep_size} needs torch.distributed initialized; valid without it: 1")
        made = ExpertGroups(1, None, (0,), None, (0,))
    else:
        world, rank = dist.get_world_size(), dist.get_rank()
        ep, edp = layout(world, ep_size)
        mine = {}
        for kind, lists in (("ep", ep), ("edp", edp)):
            for ranks in lists:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = (group, tuple(ranks))
        made = ExpertGroups(ep_size, *mine["ep"], *mine["edp"])
    _MADE[ep_size] = made
    return made
