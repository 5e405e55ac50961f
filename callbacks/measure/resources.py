"""ResourceMonitor: where each training step's time and memory went, per rank.

Every moment between two step ends is attributed to exactly one part, from one clock
(``time.perf_counter``), so the parts of a step add up to its wall time by construction:

* ``data``: fetching the next batch (the loader's ``__next__``, moving it to the device);
* ``forward``: the training step (a pipeline's whole schedule: it interleaves its backwards);
* ``backward``: autograd and the strategy's work around it (gradient buckets);
* ``comm_wait``: time the rank sat *blocked* waiting for communication - in the ZeRO in-flight
  layer's ``wait()``, a synchronous collective, a pipeline transfer; under DDP estimated from its
  buckets' completion times, as its reducer waits in C++ - taken out of the phase it interrupted;
* ``io_wait``: time blocked waiting on NVMe offload's swap-file reads and writes, likewise;
* ``optimizer``: the optimizer step (gradient readiness, unscale, clipping, the inner step);
* ``refresh``: bringing the working parameters up to date after the step (ZeRO's all-gathers)
  and zeroing the gradients;
* ``checkpoint``: checkpoint I/O (``Trainer.save_checkpoint``);
* ``validation``: validation run inside the step's interval;
* ``other``: everything else: callbacks' and the module's hooks, logging.

``comm_overlapped`` is reported beside them (not part of the sum): how long at least one
collective was in flight during the step minus the blocked time - communication hidden behind
computation. Disk I/O per step (NVMe offload's swap files, through its O_DIRECT threads, and the
step's write-backs of the parameter files; those files' page-cache reads are the kernel's and
not seen): ``io_read`` and ``io_written``
bytes and ``io_busy``, how long at least one read or write ran (not part of the sum either), so
bytes / ``io_busy`` is the bandwidth achieved. Memory per step: the process's peak RSS and, on
CUDA, the allocator's allocated, reserved and peak bytes. The mesh (``mesh_memory.py``): at train
start the job's shape (data x sequence x tensor x pipeline stages) and each rank's parameter bytes,
measured against the estimate from the whole model's split by its tensor plan (``summary["mesh"]``,
every rank's ``params_measured`` / ``params_estimate`` in ``summary["ranks"]``, a line of the table).

Each step goes to the loggers every ``log_every_n_steps`` (``time/forward``... in seconds,
``memory/rss_peak_gb``...: global rank 0's values, as every callback metric); at the end of
``fit`` every rank's means are gathered and a table printed: per part the mean over ranks, the
max over ranks and the share of the step; with ``json_path`` global rank 0 also writes every rank's
per-step records there (what ``zerotrain-tune`` reads: no table to parse). The timing hooks (``strategies/instrument.py``) cost a
global read when no monitor is attached, and never touch a tensor's values.
"""
from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch

from ...strategies import instrument
from ...strategies.paths import directory_problem
from ..base import Callback
from .mesh_memory import format_mesh_line, mesh_report, param_split

PARTS = ("data", "forward", "backward", "comm_wait", "io_wait", "optimizer", "refresh", "checkpoint", "validation",
         "other")
#: the loop's phases (``HookDispatcher.mark``) and the step's marks -> the part that starts
_PART_OF = {"fetching the next training batch": "data", "training_step": "forward", "backward": "backward",
            "optimizer_step": "optimizer", "refresh": "refresh", "checkpoint": "checkpoint",
            "validation_step": "validation", "on_validation_epoch_end": "validation"}


class StepTimer:
    """The ``instrument`` timer: accumulates the current part's stretch at every switch, and
    moves blocked time from the part it happened in to ``comm_wait`` (or ``io_wait``)."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.current = "other"
        self.since = self.start = time.perf_counter()
        self._blocked = 0.0  # already moved out of the current stretch

    def phase(self, name: str) -> None:
        self.enter(_PART_OF.get(name, "other"))

    def enter(self, name: str) -> str:
        now = time.perf_counter()
        self.parts[self.current] += now - self.since
        prev, self.current, self.since, self._blocked = self.current, name, now, 0.0
        return prev

    def blocked(self, seconds: float, part: str = "comm_wait") -> None:
        # a wait lies inside the current stretch (one thread): never move more than it holds
        seconds = max(0.0, min(seconds, time.perf_counter() - self.since - self._blocked))
        self._blocked += seconds
        self.parts[part] += seconds
        self.parts[self.current] -= seconds

    def close(self) -> tuple[dict[str, float], float, float]:
        """The parts since the last close (seconds), and the interval [start, end) they cover."""
        self.enter(self.current)
        out, self.parts = self.parts, dict.fromkeys(PARTS, 0.0)
        start, self.start = self.start, self.since
        return out, start, self.since


class ResourceMonitor(Callback):
    """See the module docstring. ``log_every_n_steps``: None follows the Trainer's;
    ``warmup_steps``: first steps left out of the end-of-fit means (when more were run);
    ``print_summary``: print the table on global rank 0; ``json_path``: global rank 0 writes
    ``{"ranks": [[record, ...] per rank]}`` there at the end of ``fit`` (every step, warm-up
    included: the reader decides what to leave out). After ``fit``: ``steps`` (this rank's records)
    and ``summary`` (every rank's means and the table's numbers)."""

    def __init__(self, log_every_n_steps: int | None = None, warmup_steps: int = 1,
                 print_summary: bool = True, json_path: str | None = None) -> None:
        if warmup_steps < 0:
            raise ValueError(f"ResourceMonitor: warmup_steps={warmup_steps!r} must be >= 0")
        self.log_every_n_steps, self.warmup_steps, self.print_summary = log_every_n_steps, warmup_steps, print_summary
        if json_path:  # found out at the end of fit otherwise, after all the training
            problem = directory_problem(os.path.dirname(os.path.abspath(os.fspath(json_path))))
            if problem:
                raise ValueError(f"ResourceMonitor: json_path={json_path!r}: its directory {problem}")
        self.json_path = json_path
        self.steps: list[dict[str, float]] = []
        self.summary: dict[str, Any] = {}
        self._timer: StepTimer | None = None
        self._events: list[instrument.Collective] = []
        self._disk: list[instrument.DiskIO] = []  # appended from the I/O threads
        self._seen_step = 0
        self._split = None  # the whole model's ParamSplit, taken at setup (before the strategy cuts it)
        self.mesh: dict[str, Any] = {}

    # ---------------------------------------------------------------- attach / detach
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # before the strategy sets up: DDP attaches its bucket watch
            instrument.add_sink(self)
            self._split = param_split(pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self.steps, self._events, self._disk = [], [], []
        self._seen_step = trainer.global_step
        if torch.cuda.is_available() and trainer.strategy.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.device)
        self.mesh = mesh_report(trainer.strategy, self._split)
        self._timer = StepTimer()
        instrument.attach_timer(self._timer)

    def collective(self, event: instrument.Collective) -> None:
        if self._timer is not None:
            self._events.append(event)

    def disk(self, event: instrument.DiskIO) -> None:
        if self._timer is not None:
            self._disk.append(event)  # list.append is atomic: safe from the I/O threads

    def _detach(self) -> None:
        if self._timer is not None:
            instrument.attach_timer(None)
            self._timer = None
        instrument.remove_sink(self)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self._detach()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._detach()

    # ---------------------------------------------------------------- per step
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._timer is None or trainer.global_step == self._seen_step:
            return  # accumulating: the step goes on
        self._seen_step = trainer.global_step
        parts, start, end = self._timer.close()
        record = {**parts, "step": sum(parts.values())}
        record["comm_overlapped"] = max(0.0, self._busy(start, end) - parts["comm_wait"])
        record.update(self._disk_step(end))
        record.update(_memory(trainer.strategy.device))
        self.steps.append(record)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every and trainer.global_step % every == 0:
            trainer.metrics_connector.emit(_metric_names(record))

    def _busy(self, start: float, end: float) -> float:
        """How long at least one collective was in flight within [start, end); collectives still
        in flight at ``end`` are kept for the next step."""
        spans, kept = [], []
        for e in self._events:
            done = e.t_done
            if done is None or done > end:
                kept.append(e)
            lo, hi = max(e.t_issue, start), min(done if done is not None else end, end)
            if hi > lo:
                spans.append((lo, hi))
        self._events = kept
        return _covered(spans, start)

    def _disk_step(self, end: float) -> dict[str, float]:
        """The step's swap-file I/O: pieces finished by ``end`` (a write-behind still running then
        counts in the next step)."""
        events, self._disk = self._disk, []
        mine = [e for e in events if e.t_done <= end]
        self._disk = [e for e in events if e.t_done > end] + self._disk
        return {"io_read": float(sum(e.nbytes for e in mine if e.kind == "read")),
                "io_written": float(sum(e.nbytes for e in mine if e.kind == "write")),
                "io_busy": _covered([(e.t_start, e.t_done) for e in mine], 0.0)}

    # ---------------------------------------------------------------- end of fit
    def on_train_end(self, trainer, pl_module) -> None:
        if self._timer is not None:
            instrument.attach_timer(None)
            self._timer = None
        mine = _means(self.steps, self.warmup_steps)
        if mine and self.mesh:
            mine.update(params_measured=self.mesh["params_measured"], params_estimate=self.mesh["params_estimate"])
        ranks = _gather(trainer.strategy, mine)
        self.summary = _table_numbers(ranks)
        if self.summary and self.mesh:
            self.summary["mesh"] = self.mesh["mesh"]
        if self.print_summary and trainer.is_global_zero and self.summary:
            print(format_table(self.summary))
        if self.json_path:
            every = _gather(trainer.strategy, self.steps)  # collective: every rank has the same json_path
            if trainer.is_global_zero:
                _write_json(self.json_path, every)


def _write_json(path: str, ranks: list[list[dict[str, float]]]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"ranks": ranks}, f)
    os.replace(path + ".tmp", path)


def _memory(device: torch.device) -> dict[str, float]:
    """Peak RSS of this process and, on CUDA, the caching allocator's numbers (bytes)."""
    out = {"rss_peak": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    if device.type == "cuda":
        out.update(cuda_allocated=float(torch.cuda.memory_allocated(device)),
                   cuda_reserved=float(torch.cuda.memory_reserved(device)),
                   cuda_peak=float(torch.cuda.max_memory_allocated(device)))
    return out


def _covered(spans: list[tuple[float, float]], start: float) -> float:
    """How long at least one of ``spans`` covers, counted from ``start``."""
    busy, reach = 0.0, start
    for lo, hi in sorted(spans):
        if hi > reach:
            busy += hi - max(lo, reach)
            reach = hi
    return busy


def _metric_names(record: dict[str, float]) -> dict[str, float]:
    """Logger names: ``time/<part>`` in seconds, ``io/read_gb``/``io/written_gb`` in GB (10^9)
    with ``io/gb_per_s`` when there was I/O, ``memory/<what>_gb`` in GiB."""
    out = {}
    for k, v in record.items():
        if k in _TIMES:
            out[f"time/{k}"] = v
        elif k in _IO_BYTES:
            out[f"io/{k[3:]}_gb"] = v / 1e9
        else:
            out[f"memory/{k}_gb"] = v / 2**30
    if record.get("io_busy"):
        out["io/gb_per_s"] = (record["io_read"] + record["io_written"]) / 1e9 / record["io_busy"]
    return out


_TIMES = (*PARTS, "step", "comm_overlapped", "io_busy")
_IO_BYTES = ("io_read", "io_written")


def _means(steps: list[dict[str, float]], warmup: int) -> dict[str, float]:
    """Means over the steps after warm-up (all of them when there are no more); memory: max."""
    kept = steps[warmup:] if len(steps) > warmup else steps
    if not kept:
        return {}
    out = {k: sum(s[k] for s in kept) / len(kept) for k in (*_TIMES, *_IO_BYTES)}
    for k in kept[-1]:
        if k not in out:
            out[k] = max(s[k] for s in kept)
    out["steps"] = len(kept)
    return out


def _gather(strategy: Any, mine: Any) -> list[Any]:
    """Every rank's means (or records) (collective when distributed: every rank calls it at ``on_train_end``)."""
    if not strategy.distributed:
        return [mine]
    import torch.distributed as dist

    out: list[Any] = [None] * strategy.world_size
    dist.all_gather_object(out, mine)
    return out


def _table_numbers(ranks: list[dict[str, float]]) -> dict[str, Any]:
    ranks = [r for r in ranks if r]
    if not ranks:
        return {}
    step = sum(r["step"] for r in ranks) / len(ranks)
    rows = {}
    for k in _TIMES:
        mean = sum(r[k] for r in ranks) / len(ranks)
        rows[k] = {"mean": mean, "max": max(r[k] for r in ranks), "share": mean / step if step else 0.0}
    memory = {k: max(r[k] for r in ranks) for k in ranks[0] if k.startswith(("rss", "cuda"))}
    return {"rows": rows, "memory": memory, "ranks": ranks, "steps": ranks[0]["steps"]}


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"ResourceMonitor: step time per rank over {summary['steps']} step(s) on {len(summary['ranks'])} "
             "rank(s) (mean over ranks, max over ranks, share of the step)",
             f"{'part':<16}{'mean ms':>10}{'max ms':>10}{'share':>9}"]
    disk = any(r.get("io_busy") for r in summary["ranks"])
    for k, r in summary["rows"].items():
        if k in ("io_wait", "io_busy") and not disk:
            continue  # no swap-file I/O in this run
        note = {"comm_overlapped": "  (hidden behind computation; not part of the sum)",
                "io_busy": "  (a read or write running; not part of the sum)"}.get(k, "")
        lines.append(f"{k:<16}{r['mean'] * 1e3:>10.2f}{r['max'] * 1e3:>10.2f}{r['share']:>9.1%}{note}")
    if disk:
        read, written, busy = (sum(r[k] for r in summary["ranks"]) / len(summary["ranks"])
                               for k in ("io_read", "io_written", "io_busy"))
        lines.append(f"disk I/O per step (mean over ranks): read {read / 1e9:.3f} GB, written {written / 1e9:.3f} GB, "
                     f"{(read + written) / 1e9 / busy:.2f} GB/s while busy")
    mem = ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in summary["memory"].items())
    lines.append(f"memory (max over ranks): {mem}")
    if "mesh" in summary:
        lines.append(format_mesh_line(summary["mesh"], summary["ranks"]))
    return "\n".join(lines)
