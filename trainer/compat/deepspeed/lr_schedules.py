"""DeepSpeed's warm-up schedules (``scheduler.type`` in its config), with its formulas and its
stepping convention: the engine steps them once per optimizer step (at the accumulation boundary),
``last_batch_iteration`` counts those steps from -1, and building one already sets the learning
rate of step 0 (``warmup_min_lr``, or 0 for WarmupCosineLR). Their state is
``{"last_batch_iteration": n}``, as DeepSpeed's.

Warm-up (``warmup_type``): "log" grows as ``log(i + 1) / log(warmup_num_steps)``, "linear" as
``i / warmup_num_steps``; ``warmup_num_steps`` is at least 2 (DeepSpeed's floor). An unknown
``warmup_type`` is an error here (DeepSpeed warns and uses "log").
"""
from __future__ import annotations

import math
from typing import Any, Sequence

WARMUP_TYPES = ("log", "linear")


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    """A scalar for every param group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}={list(value)!r}: {len(value)} values for {len(optimizer.param_groups)} param "
                             f"groups; valid: one number, or one per param group")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class _Warmup:
    """The shared part: the warm-up fraction, the step counter, writing the rates."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int) -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
            raise ValueError(f"warmup_num_steps={warmup_num_steps!r}: not a positive integer; valid: an integer >= 1")
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type={warmup_type!r}: unknown; valid: {', '.join(WARMUP_TYPES)}")
        self.optimizer = optimizer
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _warmup_fraction(self) -> float:
        """0 -> 1 over the warm-up (only called while ``last_batch_iteration < warmup_num_steps``)."""
        i = self.last_batch_iteration
        if self.warmup_type == "log":
            return math.log(i + 1) / math.log(self.warmup_num_steps)
        return i / self.warmup_num_steps

    def _start(self) -> None:
        if self.last_batch_iteration == -1:
            self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_lr(self) -> list[float]:  # each schedule's rates at ``last_batch_iteration``
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr: no rate set yet; valid: after step()")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Warmup):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: each group's ``lr``) over
    ``warmup_num_steps``, then constant."""

    def __init__(self, optimizer: Any, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self._start()

    def _gamma(self) -> float:
        return self._warmup_fraction() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warm-up, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps={total_num_steps!r}: not a positive integer; valid: an integer >= 1")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Warmup):
    """Each group's ``lr`` times a ratio: from ``warmup_min_ratio`` to 1 over the warm-up, then a
    cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps={total_num_steps!r}: not a positive integer; valid: an integer >= 1")
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = float(warmup_min_ratio), float(cos_min_ratio)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        self._start()

    def ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        r = self.ratio()
        return [lr * r for lr in self.org_lrs]
