"""DeepSpeed's schedules (``scheduler.type`` in its config): the warm-ups, the LR range test and
the one-cycle policy, with its formulas and its
stepping convention: the engine steps them once per optimizer step (at the accumulation boundary),
``last_batch_iteration`` counts those steps from -1, and building one already sets the learning
rate of step 0 (``warmup_min_lr``, or 0 for WarmupCosineLR). Their state is
``{"last_batch_iteration": n}``, as DeepSpeed's.

Warm-up (``warmup_type``): "log" grows as ``log(i + 1) / log(warmup_num_steps)``, "linear" as
``i / warmup_num_steps``; ``warmup_num_steps`` is at least 2 (DeepSpeed's floor). An unknown
``warmup_type`` given to a class warns and uses "log", as DeepSpeed's classes do; in a config's
``scheduler.params`` it is an error (``config.py``), as every value zerotrain would not use.

A param group whose ``lr`` is a tensor keeps that tensor: the rates are written into it, as
DeepSpeed 0.19.8's ``update_lr`` does (a compiled optimizer step reads it in place).

``LRRangeTest`` and ``OneCycle`` (DeepSpeed's tutorials "lrrt" and "one-cycle") follow the same
convention; ``OneCycle`` also cycles Adam's first beta (and, as DeepSpeed does, sets the second to
0.99) when the optimizer has ``betas``.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Sequence

import torch

log = logging.getLogger("zerotrain")

WARMUP_TYPES = ("log", "linear")

# DeepSpeed's names for the schedules and their parameters (``deepspeed.runtime.lr_schedules``)
LR_SCHEDULE, LR_RANGE_TEST, ONE_CYCLE = "lr_schedule", "LRRangeTest", "OneCycle"
WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE, DECAY_LR_RATE = "decay_step_size", "decay_lr_rate"
CYCLE_MIN_LR, CYCLE_MAX_LR = "cycle_min_lr", "cycle_max_lr"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR = "warmup_min_lr", "warmup_max_lr"
WARMUP_NUM_STEPS, WARMUP_TYPE = "warmup_num_steps", "warmup_type"
WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"


def _per_group(optimizer: Any, value: Any, name: str) -> list[float]:
    """A scalar for every param group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}={list(value)!r}: {len(value)} values for {len(optimizer.param_groups)} param "
                             f"groups; valid: one number, or one per param group")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


def _write_lr(group: dict, lr: Any) -> None:
    """Set a param group's rate: into its tensor when ``lr`` is one, else as the number."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
    else:
        group["lr"] = lr


class _Warmup:
    """The shared part: the warm-up fraction, the step counter, writing the rates."""

    def __init__(self, optimizer: Any, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int) -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps < 1:
            raise ValueError(f"warmup_num_steps={warmup_num_steps!r}: not a positive integer; valid: an integer >= 1")
        if warmup_type not in WARMUP_TYPES:
            log.warning("%s: warmup_type=%r unknown (valid: %s); the log warm-up is used, as DeepSpeed does",
                        type(self).__name__, warmup_type, ", ".join(WARMUP_TYPES))
            warmup_type = WARMUP_LOG_RATE
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
            _write_lr(group, lr)
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
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        """The factor on each group's ``lr`` at ``last_batch_iteration`` (0 before the first step)."""
        return self.ratio()

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


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}={value!r}: not a positive number; valid: a number > 0")
    return float(value)


class _Stepped(_Warmup):
    """``_Warmup``'s counter, ``step``, ``get_last_lr`` and state, without a warm-up."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer, self.last_batch_iteration = optimizer, last_batch_iteration
        self._last_lr = None


class LRRangeTest(_Stepped):
    """The LR range test: ``min_lr * (1 + step_rate * k)``, with ``k`` the steps taken (counted
    from 1) over ``step_size``, whole intervals only with ``staircase``."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size < 1:
            raise ValueError(f"lr_range_test_step_size={lr_range_test_step_size!r}: not a positive integer; "
                             "valid: an integer >= 1")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:  # step 0's rate is the minimum (k = 0)
            self._apply()

    def get_lr(self) -> list[float]:
        k = (self.last_batch_iteration + 1) / self.step_size
        k = math.floor(k) if self.staircase else k
        return [lr * (1 + self.step_rate * k) for lr in self.min_lrs]


class OneCycle(_Stepped):
    """One cycle of ``cycle_first_step_size`` steps up from ``cycle_min_lr`` to ``cycle_max_lr``
    and ``cycle_second_step_size`` (default: the first) back down, optionally in
    ``cycle_*_stair_count`` flat stairs; after it the rate decays as ``min_lr / (1 + decay_lr_rate *
    n / decay_step_size)`` (n: steps since the cycle; no decay when either is 0). The momentum
    (Adam's first beta) runs the other way, ``cycle_max_mom`` down to ``cycle_min_mom`` and back, then
    grows by ``1 + decay_mom_rate * n / decay_step_size``; the second beta is 0.99 throughout."""

    def __init__(self, optimizer: Any, cycle_min_lr: float | Sequence[float], cycle_max_lr: float | Sequence[float],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.up = _positive("cycle_first_step_size", cycle_first_step_size)
        self.down = self.up if cycle_second_step_size is None else float(cycle_second_step_size)
        if self.down < 0:
            raise ValueError(f"cycle_second_step_size={cycle_second_step_size!r}: negative; valid: a number >= 0")
        self.total = self.up + self.down
        self.step_ratio = self.up / self.total  # the rising part of the cycle (1.0 without a falling one)
        self.stairs = (cycle_first_stair_count,
                       cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        self.decay_lr = not (no_decay or math.isclose(self.decay_lr_rate, 0))
        self.decay_mom = not (no_decay or math.isclose(self.decay_mom_rate, 0))
        self.cycle_momentum = bool(cycle_momentum) and "betas" in getattr(optimizer, "defaults", {})
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if last_batch_iteration == -1:  # DeepSpeed sets the minimum rate (and momentum) at once
            for group, lr, mom in zip(optimizer.param_groups, self.min_lrs, self.min_moms):
                _write_lr(group, lr)
                if self.cycle_momentum:
                    group["betas"] = (mom, 0.99)

    def _height(self) -> float:
        """0 -> 1 -> 0 over the cycle (the position of the step after ``last_batch_iteration``)."""
        n = self.last_batch_iteration + 1
        x = 1.0 + n / self.total - math.floor(1 + n / self.total)  # the position in the cycle
        ratio = self.step_ratio  # DeepSpeed's arithmetic (up / total), so that the rates are its to the last bit
        rising = x <= ratio
        h = x / ratio if rising else (x - 1) / (ratio - 1)
        stairs = self.stairs[0] if rising else self.stairs[1]
        if stairs > 0:  # flat stairs, counted from the whole step number (no float drift at the peak)
            into = n % self.total
            h = math.floor((into if into <= self.up else self.total - into) * stairs
                           / (self.up if into <= self.up else self.down)) / stairs
        return h

    def _after_cycle(self) -> float | None:
        """Steps since the cycle ended (from 1), or None inside it."""
        i = self.last_batch_iteration
        return None if i < self.total else i - self.total + 1

    def get_lr(self) -> list[float]:
        n = self._after_cycle()
        if n is None:
            h = self._height()
            return [lo + (hi - lo) * h for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if not self.decay_lr:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * (n / self.decay_step_size)) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        n = self._after_cycle()
        if n is None:
            h = self._height()
            return [(hi - (hi - lo) * h, 0.99) for lo, hi in zip(self.min_moms, self.max_moms)]
        grow = 1 + self.decay_mom_rate * (n / self.decay_step_size) if self.decay_mom else 1.0
        return [(hi * grow, 0.99) for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        for group, mom in zip(self.optimizer.param_groups, moms or ()):
            group["betas"] = mom


__all__ = [
    "WARMUP_TYPES", "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
    "WARMUP_COSINE_LR", "VALID_LR_SCHEDULES", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE",
    "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE", "EDGE_VALUE", "MID_VALUE",
    "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE",
    "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE",
    "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR",
    "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO",
    "COS_MIN_RATIO", "TOTAL_NUM_STEPS", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest",
    "OneCycle"]
