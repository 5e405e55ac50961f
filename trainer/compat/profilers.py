"""Lightning's profiler classes (``lightning.pytorch.profilers``): ``PassThroughProfiler`` records
nothing, ``SimpleProfiler`` times named actions (``with profiler.profile("name"):``) and reports
each one's count, mean and total. zerotrain's Trainer does not time its own phases through them
(its ``ResourceMonitor`` callback gives a per-phase step breakdown)."""
from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Any, Iterator


class Profiler:
    """Named actions started and stopped; ``summary()`` the report, written to
    ``dirpath/filename.txt`` by ``describe()`` when both are given (printed otherwise)."""

    def __init__(self, dirpath: "str | os.PathLike | None" = None, filename: str | None = None) -> None:
        self.dirpath = dirpath
        self.filename = filename
        self._stage: str | None = None
        self._local_rank: int | None = None

    def start(self, action_name: str) -> None:
        raise NotImplementedError

    def stop(self, action_name: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        self.start(action_name)
        try:
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self._stage, self._local_rank = stage, local_rank
        self.dirpath = self.dirpath or log_dir

    def describe(self) -> None:
        text = self.summary()
        if self.dirpath is not None and self.filename:
            os.makedirs(self.dirpath, exist_ok=True)
            name = f"{self._stage}-{self.filename}" if self._stage else self.filename
            with open(os.path.join(self.dirpath, f"{name}.txt"), "a") as f:
                f.write(text)
        elif text:
            print(text)

    def teardown(self, stage: str | None) -> None:
        self._stage = None


class PassThroughProfiler(Profiler):
    """Records nothing; its summary is empty."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def summary(self) -> str:
        return ""


class SimpleProfiler(Profiler):
    """Each action's durations (``time.monotonic``); ``summary()`` a table of action, calls, mean
    and total seconds (and the share of the whole with ``extended``)."""

    def __init__(self, dirpath: "str | os.PathLike | None" = None, filename: str | None = None,
                 extended: bool = True) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.start_time = time.monotonic()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.monotonic()

    def stop(self, action_name: str) -> None:
        end = time.monotonic()
        if action_name not in self.current_actions:
            raise ValueError(f"Attempting to stop recording an action ({action_name}) which was never started.")
        self.recorded_durations[action_name].append(end - self.current_actions.pop(action_name))

    def summary(self) -> str:
        if not self.recorded_durations:
            return ""
        total = time.monotonic() - self.start_time
        rows = sorted(((name, len(d), sum(d)) for name, d in self.recorded_durations.items()),
                      key=lambda r: r[2], reverse=True)
        width = max(len("Action"), *(len(r[0]) for r in rows))
        head = f"{'Action':<{width}} | {'Calls':>8} | {'Mean (s)':>12} | {'Total (s)':>12}"
        head += " | Percentage %" if self.extended else ""
        lines = ["Profiler Report", head, "-" * len(head)]
        for name, calls, spent in rows:
            line = f"{name:<{width}} | {calls:>8} | {spent / calls:>12.6f} | {spent:>12.6f}"
            lines.append(line + (f" | {100 * spent / total:>11.2f}" if self.extended and total > 0 else ""))
        return "\n".join(lines) + "\n"


def profiler_of(profiler: Any) -> Profiler:
    """``Trainer(profiler=...)``'s value as a profiler: None a PassThroughProfiler, ``"simple"``
    (any case) a SimpleProfiler, a Profiler itself; anything else a ValueError naming the choices."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        return profiler
    if isinstance(profiler, str) and profiler.lower() == "simple":
        return SimpleProfiler()
    if isinstance(profiler, str) and profiler.lower() == "pytorch":
        return PyTorchProfiler()
    raise ValueError(f"profiler={profiler!r}; valid: None, 'simple', 'pytorch' or a Profiler instance (zerotrain "
                     "has no 'advanced' or 'xla' profiler)")


from .torch_profiler import PyTorchProfiler  # noqa: E402  (it builds on Profiler above)

__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "PyTorchProfiler"]
