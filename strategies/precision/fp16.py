"""fp16 mixed precision with a dynamic loss scaler.

The scaler follows the DeepSpeed/Megatron rules, which users of those libraries expect:

* every step whose gradients hold an inf/nan is skipped, on every rank together;
* an overflow spends one unit of *hysteresis*; when none is left the scale is multiplied by
  ``backoff_factor`` (never below ``min_scale``);
* after ``growth_interval`` consecutive good steps the scale is multiplied by ``growth_factor``
  and the hysteresis is refilled;
* an overflow while the scale already sits at ``min_scale`` raises :class:`LossScaleError` instead
  of skipping steps forever.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .base import Precision


class LossScaleError(RuntimeError):
    """Raised when gradients keep overflowing at the minimum loss scale."""


@dataclass
class DynamicLossScaler:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        """Each option's rule; the message reads ``field=value: rule; valid: ...`` (the CLI puts
        ``precision.`` in front of it)."""
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        rules = {
            "init_scale": (number(self.init_scale) and self.init_scale > 0, "must be > 0", "e.g. 65536.0"),
            "growth_factor": (number(self.growth_factor) and self.growth_factor > 1, "must be > 1", "e.g. 2.0"),
            "backoff_factor": (number(self.backoff_factor) and 0 < self.backoff_factor < 1, "must be in (0, 1)",
                               "e.g. 0.5"),
            "growth_interval": (whole(self.growth_interval) and self.growth_interval >= 1,
                                "must be an integer >= 1", "1, 2, ..."),
            "hysteresis": (whole(self.hysteresis) and self.hysteresis >= 1, "must be an integer >= 1", "1, 2, ..."),
            "min_scale": (number(self.min_scale) and number(self.init_scale) and 0 < self.min_scale <= self.init_scale,
                          "must be > 0 and <= init_scale", f"(0, {self.init_scale!r}]"),
        }
        for field, (ok, rule, valid) in rules.items():
            if not ok:
                raise ValueError(f"DynamicLossScaler: {field}={getattr(self, field)!r}: {rule}; valid: {valid}")
        self.scale = float(self.init_scale)
        self.good_steps = 0
        self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= self.min_scale:
                raise LossScaleError(
                    f"gradients overflowed at the minimum loss scale {self.min_scale}: the model "
                    "diverges in fp16. Lower the learning rate, clip gradients, or use bf16-mixed."
                )
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


class FP16Mixed(Precision):
    name = "16-mixed"
    skips_nonfinite_steps = True
    param_dtype = torch.float16
    autocast_dtype = torch.float16

    def __init__(self, scaler: DynamicLossScaler | None = None) -> None:
        self.scaler = scaler or DynamicLossScaler()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor], any_rank: Callable[[bool], bool]
    ) -> bool:
        inv = 1.0 / self.scaler.scale
        local_overflow = False
        for g in grads:
            if g is None or g.numel() == 0:
                continue
            g.mul_(inv)
            if not local_overflow:
                # one sum per tensor; an inf or nan anywhere makes the sum non-finite
                local_overflow = not math.isfinite(float(g.float().sum()))
        return any_rank(local_overflow)

    def update(self, overflow: bool) -> None:
        self.scaler.update(overflow)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)
