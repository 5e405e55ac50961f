"""The pipeline strategy's options, validated once when it is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..options import check_bool, check_choice, whole_number
from ...trainer.errors import ConfigError
from .schedule import SCHEDULES, check_interleaved


@dataclass(frozen=True)
class PipelineConfig:
    #: pipeline stages (None: one per process); the world is stages x data-parallel replicas
    stages: Optional[int] = None
    #: "1f1b" (one forward one backward: at most `stages` micro-batches of activations held) or
    #: "gpipe" (all forwards, then all backwards) or "zb_h1" (1F1B with each backward split: the
    #: inputs' gradients first, the linear layers' weight gradients later, where the stage would
    #: otherwise wait; a third of 1F1B's bubble at the same peak of live activations)
    schedule: str = "1f1b"
    #: micro-batches each batch is split into (the batch size must divide by it)
    micro_batches: int = 4
    #: recompute each stage's forward in its backward
    activation_checkpointing: bool = False
    #: model chunks per stage (interleaved 1F1B: layers cut into stages x virtual_stages chunks,
    #: stage s holding chunks s, s + stages, ...; the bubble shrinks by this factor). 1: plain 1F1B.
    #: Needs schedule="1f1b" and micro_batches a multiple of stages.
    virtual_stages: int = 1
    #: 1: partition each stage's optimizer state (fp32 masters + optimizer state) over the
    #: stage's data-parallel replicas (ZeRO-1); 0: every replica holds it whole
    zero_stage: int = 0
    #: log every collective and point-to-point transfer and summarise them at the end of fit
    #: (``callbacks.CommsLogger``)
    comms_logger: bool = False

    def __post_init__(self) -> None:
        if self.stages is not None:
            object.__setattr__(self, "stages", whole_number("pipeline", "stages", self.stages, 1))
        check_choice("pipeline", "schedule", self.schedule, SCHEDULES)
        object.__setattr__(self, "micro_batches", whole_number("pipeline", "micro_batches", self.micro_batches, 1))
        check_bool("pipeline", "activation_checkpointing", self.activation_checkpointing)
        object.__setattr__(self, "virtual_stages", whole_number("pipeline", "virtual_stages", self.virtual_stages, 1))
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1):
            raise ValueError(f"pipeline: zero_stage={self.zero_stage!r}; valid choices: 0, 1 (ZeRO-1 over each "
                             "stage's replicas)")
        if self.virtual_stages > 1 and self.schedule != "1f1b":
            raise ConfigError(f"pipeline: virtual_stages={self.virtual_stages} with schedule={self.schedule!r}: "
                              "only 1F1B interleaves chunks; valid: schedule='1f1b', or virtual_stages=1")
        if self.schedule == "zb_h1" and self.activation_checkpointing:
            raise ConfigError("pipeline: schedule='zb_h1' with activation_checkpointing=True: a recomputed "
                              "forward cannot defer its weight gradients; valid: schedule='1f1b', or "
                              "activation_checkpointing=False")
        if self.stages is not None:
            self.check_grid(self.stages)
        check_bool("pipeline", "comms_logger", self.comms_logger)

    def check_grid(self, stages: int) -> None:
        """What the interleaved schedule needs of the stage count (known here or at set-up)."""
        try:
            check_interleaved(stages, self.micro_batches, self.virtual_stages)
        except ValueError as err:
            raise ConfigError(str(err)) from None
