"""ZeRO: partition optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) over
data-parallel ranks.

Pieces, smallest first: ``layout`` (pure partition arithmetic), ``comm`` (collectives returning
handles), ``inflight`` (every collective in flight, typed by what it is for, and the one place that
waits on a handle), ``flat_buffer`` (working parameters as views of one flat buffer per param
group), ``sharded_optimizer`` (fp32 master slices + the user's optimizer re-targeted onto them),
``hooks`` (every hook of every stage, in one place), ``strategy`` (the shared step and
checkpoints), ``reduction`` (bucketed gradient reduction during backward), ``stage1`` / ``stage2``
(how gradients reach each rank's partition) and ``estimate`` (the memory formulas). Stage 3 adds
``unit_plan`` (which parameters are gathered together), ``unit`` (one unit's shards and state
machine), ``stage3_runtime`` (what each forward/backward event does), ``touch`` and
``materialize`` (partitioned construction) and ``stage3``.
"""
from __future__ import annotations

from typing import Callable

from .config import ZeroConfig
from .stage1 import ZeroStage1
from .stage2 import ZeroStage2
from .stage3 import Stage3Config, ZeroStage3
from .strategy import ZeroStrategy


def register_zero(register: Callable[[str, Callable], None]) -> None:
    register("zero1", ZeroStage1)
    register("zero2", ZeroStage2)
    register("zero3", ZeroStage3)


__all__ = ["ZeroConfig", "ZeroStrategy", "ZeroStage1", "ZeroStage2", "ZeroStage3", "Stage3Config",
           "register_zero"]
