"""Timer: stop fit once a wall-clock budget is spent (Lightning's ``Timer`` callback)."""
from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any

from .base import Callback

log = logging.getLogger("zerotrain")

INTERVALS = ("step", "epoch")


def parse_duration(duration: "str | timedelta | dict[str, int] | None") -> timedelta | None:
    """Lightning's forms: ``"DD:HH:MM:SS"``, a ``timedelta``, or ``timedelta``'s keywords as a dict."""
    if duration is None or isinstance(duration, timedelta):
        return duration
    if isinstance(duration, dict):
        return timedelta(**duration)
    m = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", str(duration).strip())
    if not m:
        raise ValueError(f"Timer: duration={duration!r}; valid: 'DD:HH:MM:SS', a datetime.timedelta or a "
                         "dict of timedelta keywords such as {'hours': 1}")
    d, h, mi, s = map(int, m.groups())
    return timedelta(days=d, hours=h, minutes=mi, seconds=s)


class Timer(Callback):
    """Tracks the time spent training and validating, and ends fit (``trainer.should_stop``) when
    the training time reaches ``duration``, checked after every step (``interval="step"``) or
    epoch. Rank 0's clock decides and the decision is broadcast, so every rank stops at the same
    step. The elapsed training time is saved in checkpoints: a resumed run keeps counting."""

    def __init__(self, duration: "str | timedelta | dict[str, int] | None" = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if interval not in INTERVALS:
            raise ValueError(f"Timer: interval={interval!r}; valid choices: {', '.join(INTERVALS)}")
        self._duration = parse_duration(duration)
        self.interval, self.verbose = interval, verbose
        self._start: dict[str, float] = {}
        self._end: dict[str, float] = {}
        self._offset = 0.0  # training seconds of the run this one resumed

    def start_time(self, stage: str = "train") -> float | None:
        return self._start.get(stage)

    def end_time(self, stage: str = "train") -> float | None:
        return self._end.get(stage)

    def time_elapsed(self, stage: str = "train") -> float:
        start, end = self._start.get(stage), self._end.get(stage)
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + (end if end is not None else time.monotonic()) - start

    def time_remaining(self, stage: str = "train") -> float | None:
        if self._duration is None:
            return None
        return self._duration.total_seconds() - self.time_elapsed(stage)

    def on_fit_start(self, trainer, module) -> None:
        self._start["train"], self._end["train"] = time.monotonic(), None

    def on_fit_end(self, trainer, module) -> None:
        self._end["train"] = time.monotonic()

    def on_validation_epoch_start(self, trainer, module) -> None:
        self._start["validate"], self._end["validate"] = time.monotonic(), None

    def on_validation_epoch_end(self, trainer, module) -> None:
        self._end["validate"] = time.monotonic()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.interval == "epoch":
            self._check(trainer)

    def _check(self, trainer) -> None:
        if self._duration is None:
            return
        stop = trainer.strategy.broadcast(self.time_elapsed() >= self._duration.total_seconds())
        if stop:
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                log.info("Timer: duration=%s elapsed: stopping at step %d", self._duration, trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in self._start}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
