"""ZeRO: partition optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) over
data-parallel ranks.

Pieces, smallest first: ``config`` (every option, once: ``ZeroSpec`` and its sections),
``layout`` (pure partition arithmetic), ``comm/`` (the collectives returning handles, the in-flight
layer that waits on them, ZeRO++'s quantized forms, the clip norm and stage 1/2's bucketed
reduction), ``flat_buffer`` (working parameters as views of one flat buffer per param group),
``sharded_optimizer`` (fp32 master slices + the user's optimizer re-targeted onto them),
``stepper`` (the default optimizer part; offload supplies the other), ``hooks`` (every hook of
every stage, in one place), ``strategy`` (the shared pieces of the step and checkpoints),
``stage1`` / ``stage2`` (how gradients reach each rank's partition), ``estimate`` (the
``zerotrain-estimate`` command over ``memory/formula.py`` and ``offload/estimate.py``) and
``stage3/`` (units, their runtime and partitioned construction). Each sub-package's ``__init__``
says which module holds what.

Never ``offload/`` or ``pipeline/``, which build on this package, but for ``estimate`` (the command,
which prints offload's bytes too; no module here imports it), which reads ``offload``'s policy and formula.
May import: ops, strategies.base, strategies.checkpoint, strategies.compile, strategies.environment, strategies.instrument, strategies.memory, strategies.moe, strategies.optimizers, strategies.options, strategies.parallel, strategies.progress, strategies.step_wrapper, strategies.offload.config, strategies.offload.estimate.
"""
from __future__ import annotations

from ..base import PROCESS_GROUP_TIMEOUT_S
from .config import BucketConfig, Stage3Config, ZeroConfig, ZeroSpec
from .stage1 import ZeroStage1
from .stage2 import ZeroStage2
from .stage3.strategy import ZeroStage3
from .stepper import ShardedStepper, Stepper
from .strategy import ZeroStrategy

_STAGE_CLASSES: dict[int, type[ZeroStrategy]] = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def zero_strategy(spec: ZeroSpec, stepper: Stepper | None = None, *,
                  process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S, tensor_parallel: int = 1) -> ZeroStrategy:
    """The ZeRO strategy of ``spec.stage`` with ``stepper`` (default: on the device), over a tensor
    axis of ``tensor_parallel`` ranks (``ZeroStrategy``'s)."""
    return _STAGE_CLASSES[spec.stage](spec, stepper, process_group_timeout_s=process_group_timeout_s,
                                      tensor_parallel=tensor_parallel)


__all__ = ["BucketConfig", "ShardedStepper", "Stepper", "Stage3Config", "ZeroConfig", "ZeroSpec", "ZeroStrategy",
           "ZeroStage1", "ZeroStage2", "ZeroStage3", "zero_strategy"]
