"""DeepSpeed 0.19.8's clip at ZeRO stages 1, 2 and 3, in its arithmetic, over zerotrain's partitions.

At ZeRO stages DeepSpeed's optimizer clips (its engine leaves ``clip_fp32_gradients`` to stage 0,
``ops/fp32_clip.py``), and the global norm is a sum over *its* partitions, rounded where its code
rounds:

* stages 1 and 2 (``stage_1_and_2.py``): each param group is one flat buffer (the trainable
  parameters in order, each padded to ``parameter_alignment`` when set, the whole to a multiple of
  ``2 * world``) cut into ``world`` equal partitions. Each rank takes the fp64 norm of each
  parameter's piece in its partition, sums their squares (fp64) and rounds the sum to fp32; the
  fp32 sums are all-reduced, the fp32 root is the group's norm. With ``offload_optimizer`` the
  squares are summed as Python floats and the root taken of the all-reduced fp32 sum's ``item()``
  (the same numbers: a correctly rounded root either way). The groups' norms are joined by
  ``vector_norm`` (fp32);
* stage 3 (``stage3.py``): each parameter is partitioned alone (``ceil(numel / world)`` elements
  a rank), the param groups cut into sub-groups (``sub_group_size``). Without offload each
  sub-group's squared partition norms are summed, all-reduced and rooted in fp64, joined in fp64,
  and the clip coefficient computed in fp64; with ``offload_optimizer`` each rank's fp64 sum is
  rounded to fp32 before the all-reduce and the rest is fp32, as at stages 1/2;
* the coefficient (``unscale_and_clip_grads``): ``clip = max(1, (norm / loss_scale + 1e-6) /
  gradient_clipping)``, the gradients multiplied by ``1 / clip`` (rounded to fp32: a 0-dim tensor
  multiplying an fp32 tensor is).

zerotrain's strategies take the norm as ``torch.nn.utils.clip_grad_norm_`` does (per-parameter
norms, then their norm) over its own partitions: the same number in exact arithmetic, one fp32
ulp apart now and then, which Adam amplifies in a near-zero gradient (DeepSpeed's
``DistributedAttention`` trained through ``initialize``: a key bias 1.3e-3 apart in 4 steps,
bench/CONFORMANCE.md). Here each zerotrain rank adds the exact squares (fp64) of the gradient
elements it holds into one entry per (DeepSpeed's norm group, DeepSpeed's rank owning them); one
fp64 all-reduce of that vector gives every rank each DeepSpeed rank's fp64 sum, and DeepSpeed's
roundings follow. fp64 sums of fp32 squares taken in another order may differ in the last fp64
bits, which reach the fp32 result only when a sum lies that close to an fp32 rounding boundary
(about ``n * 2**-29`` of the time for ``n`` elements). The all-reduce of more than two fp32 sums is
taken in rank order (a ring's order may differ in the last bit: not reproduced).

Where this is not used (the strategy's own clip stays): fp16 (the loss scale joins the
coefficient), ``torch_autocast``, tensor or sequence axes and MoE experts (norms over other
groups), ``round_robin_gradients`` (another partition order), and bf16 at stage 1 with fp32
gradient accumulation (``data_types.grad_accum_dtype``: DeepSpeed's BF16_Optimizer, another sum).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .....strategies.zero.comm.collectives import all_reduce_sum
from .stage3_tail import SUB_GROUP_SIZE, sub_groups


def _zero_section(cfg: Any) -> dict[str, Any]:
    return cfg.raw.get("zero_optimization") or {}


def _offloaded(cfg: Any) -> bool:
    device = (_zero_section(cfg).get("offload_optimizer") or {}).get("device", "none")
    return device not in (None, "none")


def applies(engine: Any) -> bool:
    """Whether the face clips with this module (see the module's docstring for what is left out)."""
    from ..moe.layer import expert_data_groups

    cfg, strategy = engine._cfg, engine.zerotrain_engine.strategy
    zero = _zero_section(cfg)
    accum = str((cfg.raw.get("data_types") or {}).get("grad_accum_dtype") or "").lower()
    bf16_optimizer = (cfg.precision == "bf16-mixed" and cfg.zero_stage == 1 and not _offloaded(cfg)
                      and accum in ("fp32", "float32", "float", "torch.float32"))
    return (cfg.zero_stage in (1, 2, 3) and cfg.precision in ("32", "bf16-mixed") and cfg.torch_autocast_dtype is None
            and not bf16_optimizer and not zero.get("round_robin_gradients", False)
            and hasattr(strategy, "master_pieces") and hasattr(strategy, "step_gradients")
            and strategy.mesh_size("tensor") == 1 and strategy.mesh_size("sequence") == 1
            and not getattr(strategy, "holds_experts", False) and not expert_data_groups(engine.module))


def zero12_owners(numels: Sequence[int], world_size: int, parameter_alignment: bool = False,
                  element_size: int = 4) -> list[list[tuple[int, int, int]]]:
    """DeepSpeed's ZeRO-1/2 partition of one param group (``numels``: its trainable parameters'
    sizes, in order): per parameter, ``(rank, first element, end)`` of each piece a rank holds."""
    align = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    offsets, at = [], 0
    for i, n in enumerate(numels):
        offsets.append(at)
        at += n
        if i != len(numels) - 1:
            at += (-at) % align
    quantum = 2 * world_size  # nccl_start_alignment_factor * world
    padded = -(-at // quantum) * quantum
    part = padded // world_size
    out = []
    for n, start in zip(numels, offsets):
        pieces, pos = [], start
        while pos < start + n:
            rank = pos // part
            stop = min(start + n, (rank + 1) * part)
            pieces.append((rank, pos - start, stop - start))
            pos = stop
        out.append(pieces)
    return out


def zero3_owners(numels: Sequence[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    """DeepSpeed's ZeRO-3 partition: each parameter alone, ``ceil(numel / world)`` a rank."""
    out = []
    for n in numels:
        pn = -(-n // world_size)
        out.append([(r, r * pn, min(n, (r + 1) * pn)) for r in range(world_size) if r * pn < n])
    return out


def norm_buckets(groups: Sequence[Sequence[torch.Tensor]], stage: int, world_size: int, zero: dict[str, Any],
                 element_size: int = 4) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
    """DeepSpeed's norm groups (stage 1/2: param groups; stage 3: sub-groups) and, per parameter
    (by ``id``), ``(bucket, first element, end)`` where bucket = norm group * world + owning rank.
    ``element_size``: of DeepSpeed's module parameters (2 in bf16), for ``parameter_alignment``.
    Returns ``(number of norm groups, that map)``."""
    where: dict[int, list[tuple[int, int, int]]] = {}
    count = 0
    for params in groups:
        numels = [p.numel() for p in params]
        if not numels:
            continue
        if stage == 3:
            owners = zero3_owners(numels, world_size)
            subs = sub_groups(numels, world_size, int(zero.get("sub_group_size", SUB_GROUP_SIZE)))
        else:
            owners = zero12_owners(numels, world_size, bool(zero.get("parameter_alignment", False)), element_size)
            subs = [list(range(len(params)))]
        for sub in subs:
            for i in sub:
                where[id(params[i])] = [((count * world_size) + r, lo, hi) for r, lo, hi in owners[i]]
            count += 1
    return count, where


def rank_sums(pieces: Sequence[Sequence[tuple[torch.Tensor, int, int, int]]], read: Any, buckets: int,
              where: dict[int, list[tuple[int, int, int]]], device: torch.device) -> torch.Tensor:
    """This rank's share of each bucket's sum of squares (fp64): ``pieces`` per slot
    ``(parameter, first element in it, first element in the slot, count)``; ``read`` the stepper's
    range reader over the step-gradient slots."""
    ranges, keys = [], []
    for slot, slot_pieces in enumerate(pieces):
        for p, p_start, s_start, n in slot_pieces:
            for bucket, lo, hi in where.get(id(p), ()):
                a, b = max(lo, p_start), min(hi, p_start + n)
                if a < b:
                    ranges.append((slot, s_start + a - p_start, b - a))
                    keys.append(bucket)
    sums = torch.zeros(buckets, dtype=torch.float64, device=device)

    def add(i: int, t: torch.Tensor) -> None:
        t = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        sums[keys[i]] += torch.dot(t, t)
    read(ranges, add)
    return sums


def _masked(norm: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's ``-1`` for a non-finite group norm."""
    return torch.where(norm.isinf() | norm.isnan(), torch.tensor(-1.0, dtype=norm.dtype, device=norm.device), norm)


def _combined(norms: list[torch.Tensor]) -> torch.Tensor:
    """``combine_grad_norm_groups``: the L2 norm of the group norms; a ``-1`` (non-finite) one
    makes it infinite."""
    stacked = torch.stack(norms)
    total = torch.linalg.vector_norm(stacked, ord=2)
    invalid = (~torch.isfinite(stacked) | (stacked < 0)).any()
    return torch.where(invalid, torch.full_like(total, float("inf")), total)


def deepspeed_norm(sums: torch.Tensor, world_size: int, stage: int, offload: bool) -> torch.Tensor:
    """DeepSpeed's global norm from every DeepSpeed rank's fp64 sum of squares per norm group
    (``sums[group * world + rank]``, all-reduced already): fp32 at stages 1/2 and offloaded stage
    3, fp64 at stage 3 without offload."""
    per_rank = sums.view(-1, world_size)
    norms = []
    for g in range(per_rank.shape[0]):
        if stage == 3 and not offload:
            norms.append(_masked(per_rank[g].sum().pow(1.0 / 2)))
            continue
        total = per_rank[g, 0].float()  # each rank's fp32 sum, then the all-reduce (rank order)
        for r in range(1, world_size):
            total = total + per_rank[g, r].float()
        if stage == 3:  # complete_grad_norm_calculation_for_cpu_offload: the fp32 tensor's root
            norms.append(_masked(total ** (1.0 / 2)))
        elif offload:  # ... stages 1/2: the root of its item(), back into an fp32 tensor
            norms.append(_masked(torch.tensor(total.item() ** (1.0 / 2), dtype=torch.float, device=sums.device)))
        else:  # get_grad_norm_direct
            norms.append(_masked(total.pow(1.0 / 2)))
    return _combined(norms)


def coefficient(norm: torch.Tensor, max_norm: float, loss_scale: float = 1.0) -> torch.Tensor:
    """``unscale_and_clip_grads``' multiplier ``1 / combined_scale``, in the norm's dtype."""
    clip = ((norm / loss_scale) + 1e-6) / max_norm
    clip = torch.clamp(clip, min=1.0)
    return 1.0 / (clip * loss_scale)


def norm_bytes(engine: Any) -> int:
    """All-reduce bytes one :func:`clip` moves (the comms logger's formula): the fp64 sum of squares
    of every (norm group, DeepSpeed rank) bucket."""
    cfg, strategy = engine._cfg, engine.zerotrain_engine.strategy
    world = strategy.data_parallel_world_size
    groups, _ = strategy.master_pieces()
    buckets, _ = norm_buckets(groups, cfg.zero_stage, world, _zero_section(cfg), 2 if cfg.bf16_enabled else 4)
    return 8 * buckets * world


def clip(engine: Any) -> bool:
    """Collective: clip the strategy's step gradients as DeepSpeed's ZeRO optimizer does. Returns
    False, changing nothing, when the norm is not finite (the strategy's own clip then runs, as
    before)."""
    cfg, strategy = engine._cfg, engine.zerotrain_engine.strategy
    world = strategy.data_parallel_world_size
    groups, pieces = strategy.master_pieces()
    buckets, where = norm_buckets(groups, cfg.zero_stage, world, _zero_section(cfg), 2 if cfg.bf16_enabled else 4)
    grads = strategy.step_gradients()
    device = strategy.device
    sums = rank_sums(pieces, strategy.stepper.norm_reader(grads), buckets * world, where, device)
    strategy.queue.complete(all_reduce_sum(sums, strategy.group), sums, label="grad norm (DeepSpeed's order)")
    norm = deepspeed_norm(sums, world, cfg.zero_stage, _offloaded(cfg))
    if not bool(torch.isfinite(norm)):
        return False
    coef = coefficient(norm, float(cfg.gradient_clipping))
    strategy._scale_grads(coef.to(torch.float32))
    return True
