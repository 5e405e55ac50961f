"""EarlyStopping: stop fit when a monitored metric stops improving (Lightning's semantics)."""
from __future__ import annotations

import logging
import math
from enum import Enum
from typing import Any

from .base import Callback

log = logging.getLogger("zerotrain")

MODES = ("min", "max")


class EarlyStoppingReason(Enum):
    """Why ``EarlyStopping`` stopped (``stopping_reason``), Lightning's values."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` checks
    in a row (``mode`` "min": lower is better; "max": higher), or at once when it is not finite
    (``check_finite``), reaches ``stopping_threshold`` or passes ``divergence_threshold``.

    Checked where Lightning checks: at the end of each training epoch when validation runs once
    per epoch (``check_on_train_epoch_end=None`` decides as Lightning does), else after each
    validation. The decision is a collective: if any rank decides to stop, every rank stops at the
    same step (``Strategy.any_rank``), so no rank waits in a collective the others left. The
    Trainer ends fit at the next step boundary once ``trainer.should_stop`` is set.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"EarlyStopping: mode={mode!r}; valid choices: {', '.join(MODES)}")
        if patience < 0:
            raise ValueError(f"EarlyStopping: patience={patience!r} must be >= 0")
        self.monitor, self.mode, self.patience, self.verbose = monitor, mode, patience, verbose
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self._check_on_train_epoch_end = check_on_train_epoch_end
        # as Lightning: the delta an improvement must exceed, signed in the direction of improvement
        self.min_delta = abs(min_delta) * (1 if mode == "max" else -1)
        self.best_score = math.inf if mode == "min" else -math.inf
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    def _better(self, a: float, b: float) -> bool:
        return a < b if self.mode == "min" else a > b

    # ---- when to check
    def setup(self, trainer, module, stage: str | None = None) -> None:
        if self._check_on_train_epoch_end is None:
            interval = getattr(trainer, "val_check_interval", None)
            every_n = getattr(trainer, "check_val_every_n_epoch", 1)
            self._check_on_train_epoch_end = interval in (None, 1.0) and every_n == 1

    def on_train_epoch_end(self, trainer, module) -> None:
        if self._check_on_train_epoch_end:
            self._run_check(trainer)

    def on_validation_epoch_end(self, trainer, module) -> None:
        if not self._check_on_train_epoch_end and not getattr(trainer, "sanity_checking", False):
            self._run_check(trainer)

    # ---- the decision
    def _run_check(self, trainer) -> None:
        current = trainer.callback_metrics.get(self.monitor)
        if current is None:
            if self.strict:
                raise RuntimeError(f"EarlyStopping: monitor={self.monitor!r} was never logged; logged: "
                                   f"{sorted(trainer.callback_metrics)} (pass strict=False to skip the check)")
            return
        stop, reason = self.evaluate(float(current))
        stop = trainer.strategy.any_rank(stop)  # every rank stops at the same step, or none does
        trainer.should_stop = bool(getattr(trainer, "should_stop", False) or stop)
        if stop:
            self.stopped_epoch = trainer.current_epoch
        if reason and (self.verbose or stop) and trainer.is_global_zero:
            log.info("EarlyStopping: %s", reason)

    def evaluate(self, current: float) -> tuple[bool, str | None]:
        """One check of the monitored value: (stop?, why). Updates ``best_score``/``wait_count`` and,
        on a stop, ``stopping_reason`` (Lightning's ``EarlyStoppingReason``) and its message."""
        stop, reason, kind = self._decide(current)
        if stop:
            self.stopping_reason, self.stopping_reason_message = kind, reason
        return stop, reason

    def _decide(self, current: float) -> tuple[bool, str | None, "EarlyStoppingReason"]:
        name, R = self.monitor, EarlyStoppingReason
        if self.check_finite and not math.isfinite(current):
            return True, f"{name}={current} is not finite; previous best {self.best_score:.3f}: stopping", \
                R.NON_FINITE_METRIC
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            return True, f"{name}={current:.3f} reached stopping_threshold={self.stopping_threshold}: stopping", \
                R.STOPPING_THRESHOLD
        if self.divergence_threshold is not None and self._better(-current, -self.divergence_threshold):
            return True, f"{name}={current:.3f} passed divergence_threshold={self.divergence_threshold}: stopping", \
                R.DIVERGENCE_THRESHOLD
        if self._better(current - self.min_delta, self.best_score):
            improved = f"{name} improved to {current:.3f}" + (
                f" (by {abs(self.best_score - current):.3f})" if math.isfinite(self.best_score) else "")
            self.best_score, self.wait_count = current, 0
            return False, improved, R.NOT_STOPPED
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (f"{name} did not improve for {self.wait_count} checks; best {self.best_score:.3f}: "
                          "stopping"), R.PATIENCE_EXHAUSTED
        return False, None, R.NOT_STOPPED

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch,
                "best_score": self.best_score, "patience": self.patience,
                "stopping_reason": self.stopping_reason.value, "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = float(state["best_score"])
        self.patience = int(state["patience"])
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
