"""``zerotrain.profilers.pytorch.PyTorchProfiler`` (also ``zerotrain.profilers.PyTorchProfiler``):
Lightning's profiler built on ``torch.profiler``. The first named action starts a
``torch.profiler.profile`` (``profiler_kwargs`` pass to it); each action is a ``record_function``
range inside it; ``summary()`` is torch's ``key_averages().table``; ``teardown`` stops it and, with
``export_to_chrome``, writes a Chrome trace ``[stage-]filename-rankN.pt.trace.json`` to ``dirpath``.
As with the other profilers, zerotrain's Trainer does not time its own phases through it."""
from __future__ import annotations

import os
from typing import Any

import torch

from .profilers import Profiler


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
