"""Loop counters, saved in every checkpoint so that a resumed run continues exactly."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LoopState:
    global_step: int = 0  # optimizer steps taken (skipped fp16 overflow steps included)
    skipped_steps: int = 0  # optimizer steps skipped for fp16 overflow
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    total_batches: int = 0  # micro-batches consumed over the whole run

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, int(value))
