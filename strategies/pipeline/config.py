"""The pipeline strategy's options, validated once when it is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..options import check_bool, check_choice, whole_number
from .schedule import SCHEDULES


@dataclass(frozen=True)
class PipelineConfig:
    #: pipeline stages (None: one per process); the world is stages x data-parallel replicas
    stages: Optional[int] = None
    #: "1f1b" (one forward one backward: at most `stages` micro-batches of activations held) or
    #: "gpipe" (all forwards, then all backwards)
    schedule: str = "1f1b"
    #: micro-batches each batch is split into (the batch size must divide by it)
    micro_batches: int = 4
    #: recompute each stage's forward in its backward
    activation_checkpointing: bool = False
    #: log every collective and point-to-point transfer and summarise them at the end of fit
    #: (``callbacks.CommsLogger``)
    comms_logger: bool = False

    def __post_init__(self) -> None:
        if self.stages is not None:
            object.__setattr__(self, "stages", whole_number("pipeline", "stages", self.stages, 1))
        check_choice("pipeline", "schedule", self.schedule, SCHEDULES)
        object.__setattr__(self, "micro_batches", whole_number("pipeline", "micro_batches", self.micro_batches, 1))
        check_bool("pipeline", "activation_checkpointing", self.activation_checkpointing)
        check_bool("pipeline", "comms_logger", self.comms_logger)
