"""Timer: stop fit once a wall-clock budget is spent (Lightning's ``Timer`` callback)."""
from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from typing import Any

from ..trainer.errors import ConfigError
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
        raise ConfigError(f"`Timer(duration={duration!r})` is not a valid duration. Expected a string in the format "
                          "DD:HH:MM:SS (or a datetime.timedelta, or a dict of timedelta keywords such as {'hours': 1})")
    d, h, mi, s = map(int, m.groups())
    return timedelta(days=d, hours=h, minutes=mi, seconds=s)


def _stage(stage: Any) -> str:
    """A stage as Lightning's ``RunningStage`` value (the enum or its string)."""
    return getattr(stage, "value", stage)


class Timer(Callback):
    """Tracks the time spent in each stage (``"train"``, ``"validate"``, ``"test"``; Lightning's
    ``RunningStage`` values) and ends fit (``trainer.should_stop``) once the training time reaches
    ``duration``, checked at fit start (a resumed run whose time is spent does not train), then
    after every step (``interval="step"``) or epoch. ``_duration`` is the budget in seconds, as
    Lightning's. Rank 0's clock decides and the decision is broadcast, so every rank stops at the
    same step. The elapsed times are saved in checkpoints: a resumed run keeps counting."""

    def __init__(self, duration: "str | timedelta | dict[str, int] | None" = None, interval: str = "step",
                 verbose: bool = True) -> None:
        if interval not in INTERVALS:
            raise ConfigError(f"Unsupported parameter value `Timer(interval={interval})`. Possible choices are: "
                              f"{', '.join(INTERVALS)}")
        duration = parse_duration(duration)
        self._duration = duration.total_seconds() if duration is not None else None
        self._interval, self._verbose = interval, verbose
        self._start: dict[str, float] = {}
        self._end: dict[str, float] = {}
        self._offset = 0.0  # training seconds of the run this one resumed

    @property
    def interval(self) -> str:
        return self._interval

    def start_time(self, stage: Any = "train") -> float | None:
        return self._start.get(_stage(stage))

    def end_time(self, stage: Any = "train") -> float | None:
        return self._end.get(_stage(stage))

    def time_elapsed(self, stage: Any = "train") -> float:
        stage = _stage(stage)
        start, end = self._start.get(stage), self._end.get(stage)
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + (end if end is not None else time.monotonic()) - start

    def time_remaining(self, stage: Any = "train") -> float | None:
        if self._duration is None:
            return None
        return self._duration - self.time_elapsed(stage)

    def _begin(self, stage: str) -> None:
        self._start[stage], self._end[stage] = time.monotonic(), None

    def on_train_start(self, trainer, pl_module) -> None:
        self._begin("train")

    def on_train_end(self, trainer, pl_module) -> None:
        self._end["train"] = time.monotonic()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._begin("validate")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._end["validate"] = time.monotonic()

    def on_test_start(self, trainer, pl_module) -> None:
        self._begin("test")

    def on_test_end(self, trainer, pl_module) -> None:
        self._end["test"] = time.monotonic()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._check(trainer)  # a restored Timer whose time is already spent: no training

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._interval == "epoch":
            self._check(trainer)

    def _check(self, trainer) -> None:
        if self._duration is None:
            return
        stop = trainer.strategy.broadcast(self.time_elapsed() >= self._duration)
        trainer.should_stop = bool(trainer.should_stop or stop)
        if stop and self._verbose and trainer.is_global_zero:
            log.info("Time limit reached. Elapsed time is %s. Signaling Trainer to stop.",
                     timedelta(seconds=int(self.time_elapsed())))

    def state_dict(self) -> dict[str, Any]:
        stages = ("train", "sanity_check", "validate", "test", "predict")
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in stages}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
