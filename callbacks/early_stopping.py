"""EarlyStopping: stop fit when a monitored metric stops improving (Lightning's semantics)."""
from __future__ import annotations

import logging
import math
import warnings
from enum import Enum
from typing import Any

import torch

from ..trainer.errors import ConfigError
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

    Checked where Lightning checks: at the end of each training epoch (after the module's own
    ``on_train_epoch_end``) when validation runs once per epoch (``check_on_train_epoch_end=None``
    decides as Lightning does), else at ``on_validation_end``; never while sanity checking, outside
    ``fit`` or with ``fast_dev_run``. The decision is a collective: if any rank decides to stop,
    every rank stops at the same step (``Strategy.any_rank``), so no rank waits in a collective the
    others left. The Trainer ends fit at the next step boundary once ``trainer.should_stop`` is set.
    The overridable pieces keep Lightning's names: ``_run_early_stopping_check(trainer)``,
    ``_evaluate_stopping_criteria(current) -> (stop, reason)`` and ``_log_info``.
    """

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: str = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False) -> None:
        if mode not in MODES:
            raise ConfigError(f"`mode` can be {', '.join(MODES)}, got {mode}")
        if patience < 0:
            raise ValueError(f"EarlyStopping: patience={patience!r} must be >= 0")
        self.monitor, self.mode, self.patience, self.verbose = monitor, mode, patience, verbose
        self.strict, self.check_finite = strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self._check_on_train_epoch_end = check_on_train_epoch_end
        self.log_rank_zero_only = log_rank_zero_only
        # as Lightning: the delta an improvement must exceed, signed in the direction of improvement
        self.min_delta = abs(min_delta) * (1 if mode == "max" else -1)
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.wait_count = 0
        self.stopped_epoch = 0
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint's ``callbacks``: the class's own
        name (a subclass's state is its own), then the settings that tell instances apart."""
        return f"{type(self).__qualname__}{ {'monitor': self.monitor, 'mode': self.mode} }"

    def _better(self, a: Any, b: Any) -> bool:
        return bool(a < b) if self.mode == "min" else bool(a > b)

    # ---- when to check
    def setup(self, trainer, pl_module, stage: str | None = None) -> None:
        if self._check_on_train_epoch_end is None:
            interval = getattr(trainer, "val_check_interval", None)
            every_n = getattr(trainer, "check_val_every_n_epoch", 1)
            self._check_on_train_epoch_end = interval in (None, 1.0) and every_n == 1

    def _skip(self, trainer) -> bool:
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        fitting = fn is None or getattr(fn, "value", fn) == "fit"
        return not fitting or bool(getattr(trainer, "sanity_checking", False))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._check_on_train_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._check_on_train_epoch_end and not self._skip(trainer):
            self._run_early_stopping_check(trainer)

    # ---- the decision
    def _run_early_stopping_check(self, trainer) -> None:
        """One check: read ``monitor`` from ``trainer.callback_metrics``, decide, agree over ranks."""
        metrics = trainer.callback_metrics
        if getattr(trainer, "fast_dev_run", False):  # as Lightning: fast_dev_run never stops early
            return
        current = metrics.get(self.monitor)
        if current is None:
            message = (f"Early stopping conditioned on metric `{self.monitor}` which is not available. Pass in or "
                       f"modify your `EarlyStopping` callback to use any of the following: "
                       f"`{'`, `'.join(metrics)}`")
            if self.strict:
                raise RuntimeError(message)
            if self.verbose:
                warnings.warn(message, RuntimeWarning)
            return
        current = current.squeeze() if torch.is_tensor(current) else torch.tensor(float(current))
        stop, reason = self._evaluate_stopping_criteria(current)
        stop = trainer.strategy.any_rank(stop)  # every rank stops at the same step, or none does
        trainer.should_stop = bool(getattr(trainer, "should_stop", False) or stop)
        if stop:
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason_message = reason
        if reason and self.verbose:
            self._log_info(trainer, reason, self.log_rank_zero_only)

    def evaluate(self, current: float) -> tuple[bool, str | None]:
        """One check of a monitored value (a number or tensor): (stop?, why); a stop also sets
        ``stopping_reason_message``."""
        stop, reason = self._evaluate_stopping_criteria(torch.as_tensor(current, dtype=torch.float32))
        if stop:
            self.stopping_reason_message = reason
        return stop, reason

    def _evaluate_stopping_criteria(self, current: torch.Tensor) -> tuple[bool, str | None]:
        """Updates ``best_score``/``wait_count`` and, on a stop, ``stopping_reason``; returns
        (stop?, why) with Lightning's wording."""
        name, R, op = self.monitor, EarlyStoppingReason, "<" if self.mode == "min" else ">"
        if self.check_finite and not torch.isfinite(current):
            self.stopping_reason = R.NON_FINITE_METRIC
            return True, (f"Monitored metric {name} = {current} is not finite. Previous best value was "
                          f"{self.best_score:.3f}. Signaling Trainer to stop.")
        if self.stopping_threshold is not None and self._better(current, self.stopping_threshold):
            self.stopping_reason = R.STOPPING_THRESHOLD
            return True, (f"Stopping threshold reached: {name} = {current} {op} {self.stopping_threshold}. "
                          "Signaling Trainer to stop.")
        if self.divergence_threshold is not None and self._better(-current, -self.divergence_threshold):
            self.stopping_reason = R.DIVERGENCE_THRESHOLD
            return True, (f"Divergence threshold reached: {name} = {current} {op} {self.divergence_threshold}. "
                          "Signaling Trainer to stop.")
        if self._better(current - self.min_delta, self.best_score.to(current.device)):
            if torch.isfinite(self.best_score):
                reason = (f"Metric {name} improved by {abs(self.best_score - current):.3f} >= min_delta = "
                          f"{abs(self.min_delta)}. New best score: {current:.3f}")
            else:
                reason = f"Metric {name} improved. New best score: {current:.3f}"
            self.best_score, self.wait_count = current, 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            self.stopping_reason = R.PATIENCE_EXHAUSTED
            return True, (f"Monitored metric {name} did not improve in the last {self.wait_count} records. "
                          f"Best score: {self.best_score:.3f}. Signaling Trainer to stop.")
        return False, None

    @staticmethod
    def _log_info(trainer, message: str, log_rank_zero_only: bool) -> None:
        """Log ``message``; with several processes prefixed ``[rank: N]``, and only on rank 0 when
        ``log_rank_zero_only``."""
        rank = trainer.global_rank if trainer.world_size > 1 else None
        if rank is None:
            log.info(message)
        elif not log_rank_zero_only or rank == 0:
            log.info(f"[rank: {rank}] {message}")

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": self.wait_count, "stopped_epoch": self.stopped_epoch,
                "best_score": self.best_score, "patience": self.patience,
                "stopping_reason": self.stopping_reason.value, "stopping_reason_message": self.stopping_reason_message}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = int(state["wait_count"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best_score = torch.as_tensor(state["best_score"])
        self.patience = int(state["patience"])
        self.stopping_reason = EarlyStoppingReason(state.get("stopping_reason", 0))
        self.stopping_reason_message = state.get("stopping_reason_message")
