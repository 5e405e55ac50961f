"""Lightning's profiler classes (``lightning.pytorch.profilers``): ``PassThroughProfiler`` records
nothing, ``SimpleProfiler`` times named actions (``with profiler.profile("name"):``) and reports
each one's count, mean and total. zerotrain's Trainer does not time its own phases through them
(its ``ResourceMonitor`` callback gives a per-phase step breakdown).

``PyTorchProfiler`` (also ``zerotrain.profilers.pytorch``): Lightning's profiler built on ``torch.profiler``. The first named action starts a
``torch.profiler.profile`` (``profiler_kwargs`` pass to it); each action is a ``record_function``
range inside it; ``summary()`` is torch's ``key_averages().table``; ``teardown`` stops it and, with
``export_to_chrome``, writes a Chrome trace ``[stage-]filename-rankN.pt.trace.json`` to ``dirpath``.
As with the other profilers, zerotrain's Trainer does not time its own phases through it."""
from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from typing import Any, Iterator

import torch


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



class PyTorchProfiler(Profiler):
    def __init__(self, dirpath: "str | os.PathLike | None" = None, filename: str | None = None,
                 group_by_input_shapes: bool = False, emit_nvtx: bool = False, export_to_chrome: bool = True,
                 row_limit: int = 20, sort_by_key: str | None = None, record_module_names: bool = True,
                 table_kwargs: dict | None = None, **profiler_kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if emit_nvtx:
            raise NotImplementedError("PyTorchProfiler(emit_nvtx=True): zerotrain has no NVTX profiling")
        self.group_by_input_shapes = group_by_input_shapes
        self.export_to_chrome, self.row_limit = export_to_chrome, row_limit
        self.sort_by_key = sort_by_key or "cpu_time_total"
        self.record_module_names = record_module_names
        self.table_kwargs = dict(table_kwargs or {})
        self.profiler_kwargs = {"record_shapes": group_by_input_shapes, **profiler_kwargs}
        self.profiler: torch.profiler.profile | None = None
        self._running = False  # torch's profile may be exited once only
        self._ranges: dict[str, Any] = {}

    def start(self, action_name: str) -> None:
        if self.profiler is None:
            self.profiler = torch.profiler.profile(**self.profiler_kwargs)
            self.profiler.__enter__()
            self._running = True
        rec = torch.autograd.profiler.record_function(action_name)
        rec.__enter__()
        self._ranges[action_name] = rec

    def stop(self, action_name: str) -> None:
        rec = self._ranges.pop(action_name, None)
        if rec is not None:
            rec.__exit__(None, None, None)

    def _finish(self) -> None:
        for name in list(self._ranges):
            self.stop(name)
        if self._running:
            self._running = False
            self.profiler.__exit__(None, None, None)

    def summary(self) -> str:
        if self.profiler is None:
            return ""
        self._finish()
        events = self.profiler.key_averages(group_by_input_shape=self.group_by_input_shapes)
        return events.table(sort_by=self.sort_by_key, row_limit=self.row_limit, **self.table_kwargs)

    def teardown(self, stage: str | None) -> None:
        if self.profiler is not None:
            self._finish()
            if self.export_to_chrome and self.dirpath is not None:
                os.makedirs(self.dirpath, exist_ok=True)
                name = "-".join(p for p in (self._stage, self.filename or "profile", f"rank{self._local_rank or 0}") if p)
                self.profiler.export_chrome_trace(os.path.join(self.dirpath, f"{name}.pt.trace.json"))
            self.profiler = None
        super().teardown(stage)


__all__ = ["PyTorchProfiler"]


__all__ = ["Profiler", "PassThroughProfiler", "SimpleProfiler", "PyTorchProfiler"]
