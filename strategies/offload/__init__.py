"""Offload: ZeRO with fp32 master weights and optimizer state in host RAM or on NVMe.

Pieces, smallest first: ``plan`` (sub-groups and the read/step/write pipeline, pure), ``aio``
(thread-pool file I/O, O_DIRECT detection, atomic files), ``swapper`` (where each sub-group's
state lives: RAM or swap files; checkpoint snapshots), ``param_swap`` (ZeRO-3 parameter shards in
files, resident only while used), ``transfer`` (gradients to the optimizer and working parameters
back: host memory or a GPU), ``optimizer`` (the fused sub-group Adam step, and the fallback for
other optimizers), ``config`` (the validated :class:`OffloadPolicy`) and ``stepper`` (the part a
ZeRO stage is composed with). :func:`Offload` composes them.

May import: strategies, ops, trainer.errors."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..base import PROCESS_GROUP_TIMEOUT_S
from ..zero import ZeroSpec, zero_strategy
from ..zero.strategy import ZeroStrategy
from .config import OffloadPolicy
from .stepper import STAGES, OffloadStepper, check_stage
_POLICY_FIELDS = frozenset(f.name for f in fields(OffloadPolicy))


def Offload(stage: int = 2, *, process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S,  # noqa: N802
            tensor_parallel: int = 1, **options: Any) -> ZeroStrategy:
    """ZeRO stage ``stage`` (2 or 3) with the optimizer offloaded: a ``ZeroStage2``/``ZeroStage3``
    whose stepper is an :class:`OffloadStepper`. ``options`` are flat: the policy's fields
    (:class:`OffloadPolicy`) and the stage's (``ZeroConfig``, ``BucketConfig`` or
    ``Stage3Config``); an option of the other stage must stay at its default. ``tensor_parallel``:
    the stage's tensor axis (each rank's shards partitioned over its replicas; the stepper sees
    only partitions, so it is the same)."""
    check_stage(stage)
    policy = OffloadPolicy(**{k: v for k, v in options.items() if k in _POLICY_FIELDS})
    spec = ZeroSpec.from_options(stage, owner="Offload",
                                 **{k: v for k, v in options.items() if k not in _POLICY_FIELDS})
    return zero_strategy(spec, OffloadStepper(policy), process_group_timeout_s=process_group_timeout_s,
                         tensor_parallel=tensor_parallel)


__all__ = ["Offload", "OffloadPolicy", "OffloadStepper", "STAGES"]
