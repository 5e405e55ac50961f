"""Which elements DeepSpeed 0.19.8's ZeRO-3 steps in its host Adam kernel's scalar tail, placed on
zerotrain's ZeRO-3 master slots.

DeepSpeed's host kernel (``ds_adam_step``: its CPU ``FusedAdam`` and ``DeepSpeedCPUAdam``) computes
the last ``numel % 16`` elements of each call with other fused products than the rest
(:func:`zerotrain.ops.fused_adam_step`, ``order="deepspeed"``), so an element's last bit depends
on where it sits in the call. Its stage 3 (``runtime/zero/stage3.py``) partitions each parameter
alone (``ceil(numel / world)`` elements per rank, the last rank's padded), cuts each param group's
trainable parameters into sub-groups of at least ``zero_optimization.sub_group_size`` partition
elements (default 1e9), and steps each sub-group's flat partition (its parameters' partitions
concatenated) in one call. zerotrain's stage 3 holds other slices (a unit's flat buffer cut into
ranks), so the stage-3 engine hands the optimizer the elements DeepSpeed's calls would end with
(``kernel_tail``: slot -> ranges, read by the face's Adam classes and ZeRO-Offload's stepper);
every other element gets the kernel's vector step, as in DeepSpeed.
"""
from __future__ import annotations

from typing import Any, Sequence

from .....ops.deepspeed_adam import DS_VECTOR_BLOCK

#: ``zero_optimization.sub_group_size``'s default in DeepSpeed 0.19.8
SUB_GROUP_SIZE = 1_000_000_000


def sub_groups(numels: Sequence[int], world_size: int, sub_group_size: int = SUB_GROUP_SIZE) -> list[list[int]]:
    """How DeepSpeed's stage 3 cuts one param group (``numels``: its trainable parameters' sizes)
    into sub-groups: the parameter indices of each, a sub-group closed once its partitions (each
    ``ceil(numel / world_size)``) reach ``sub_group_size`` elements."""
    subs: list[list[int]] = []
    sub: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        sub.append(i)
        size += -(-n // world_size)
        if size >= sub_group_size or i == len(numels) - 1:
            subs.append(sub)
            sub, size = [], 0
    return subs


def deepspeed_tail_elements(groups: Sequence[Sequence[int]], world_size: int,
                            sub_group_size: int = SUB_GROUP_SIZE) -> list[list[list[tuple[int, int]]]]:
    """``groups[g][i]``: the number of elements of trainable parameter ``i`` of param group ``g``.
    Returns, per group and parameter, the ``[start, end)`` ranges (in the whole parameter's flat
    index) that some rank's DeepSpeed stage-3 call steps as its scalar tail."""
    out = []
    for numels in groups:
        ranges: list[list[tuple[int, int]]] = [[] for _ in numels]
        for sub in sub_groups(numels, world_size, sub_group_size):
            parts = [(i, -(-numels[i] // world_size)) for i in sub]
            total = sum(pn for _, pn in parts)
            first_tail = total - total % DS_VECTOR_BLOCK
            for rank in range(world_size):
                offset = 0
                for i, pn in parts:
                    lo, hi = max(offset, first_tail), offset + pn
                    start, end = rank * pn + lo - offset, min(rank * pn + hi - offset, numels[i])
                    if lo < hi and start < end:
                        ranges[i].append((start, end))
                    offset += pn
        out.append(ranges)
    return out


def slot_tails(groups: Sequence[Sequence[Any]], slots: Sequence[Sequence[tuple[Any, int, int, int]]],
               world_size: int, sub_group_size: int = SUB_GROUP_SIZE) -> dict[int, list[tuple[int, int]]]:
    """``kernel_tail`` for a ZeRO-3 strategy's ``master_pieces()`` (``groups``: the trainable
    parameters per param group in the optimizer's order; ``slots``: each master slot's pieces
    ``(parameter, start in it, start in the slot, count)``): slot -> ranges in the slot, every slot
    present (an empty list: no element of it is in a DeepSpeed tail)."""
    elements = deepspeed_tail_elements([[p.numel() for p in g] for g in groups], world_size, sub_group_size)
    where = {id(p): r for g, rs in zip(groups, elements) for p, r in zip(g, rs)}
    out: dict[int, list[tuple[int, int]]] = {}
    for k, pieces in enumerate(slots):
        got = []
        for p, p_start, s_start, count in pieces:
            for lo, hi in where.get(id(p), ()):
                a, b = max(lo, p_start), min(hi, p_start + count)
                if a < b:
                    got.append((s_start + a - p_start, s_start + b - p_start))
        out[k] = sorted(got)
    return out


def use_deepspeed_tail(strategy: Any, raw: dict[str, Any]) -> None:
    """After the stage-3 engine's set-up: give its optimizer, when it steps with DeepSpeed's kernel
    (``kernel_order``), DeepSpeed's tail elements on its slots."""
    if getattr(strategy.optimizer, "kernel_order", None) != "deepspeed":
        return
    zero = raw.get("zero_optimization") or {}
    groups, slots = strategy.master_pieces()
    strategy.optimizer.kernel_tail = slot_tails(groups, slots, strategy.data_parallel_world_size,
                                                int(zero.get("sub_group_size", SUB_GROUP_SIZE)))
