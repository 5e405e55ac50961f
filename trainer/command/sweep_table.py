"""The table that ends a ``zerotrain-train --multirun`` sweep: one row per job (its overrides, its
final losses, mean step time and peak memory), printed and written as ``sweep_table.md`` and
``sweep_table.json`` in the sweep's folder.

A Hydra callback (``hydra.callbacks.sweep_table`` in ``conf/config.yaml``): Hydra's launcher runs
the jobs one after another in the first process, each a multi-process training run of its own in its
own folder (the ranks of a job re-run that job's overrides only, ``trainer/launch/launcher.py``); each job
returns its numbers (``train.run_numbers``), which ``on_job_end`` collects.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from hydra.experimental.callback import Callback

_FIXED = ("steps", "step_ms", "peak_gib")


def swept(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The override keys whose values differ between the jobs, each with every job's value."""
    values = [dict(o.lstrip("+").partition("=")[::2] for o in r.get("overrides", [])) for r in rows]
    keys = [k for k in dict.fromkeys(k for v in values for k in v) if len({v.get(k) for v in values}) > 1]
    return {k: [v.get(k, "-") for v in values] for k in keys}


def format_table(rows: list[dict[str, Any]]) -> str:
    """``rows``: ``{"overrides": [...], "status": ..., <numbers>}``. One column per swept key, the
    status, the losses, then steps, mean step time (ms) and peak memory (GiB, max over ranks)."""
    keys = swept(rows)
    losses = sorted({k for r in rows for k in r if k.endswith("loss")})
    columns = ["job", *keys, "status", *losses, *_FIXED]

    def cell(row: dict[str, Any], col: str) -> str:
        value = row.get(col)
        if col in keys:
            return keys[col][row["job"]]
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4f}" if col.endswith("loss") else f"{value:.3g}"
        return "-" if value is None else str(value)

    body = [[cell(dict(r, job=i), c) for c in columns] for i, r in enumerate(rows)]
    widths = [max(len(c), *(len(b[j]) for b in body)) for j, c in enumerate(columns)]
    line = lambda cells: "| " + " | ".join(x.ljust(w) for x, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


class SweepTable(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        self.rows = []

    def on_job_end(self, config, job_return, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        row: dict[str, Any] = {"overrides": list(job_return.overrides or [])}
        if job_return.status == JobStatus.COMPLETED:
            row["status"] = "ok"
            value = job_return.return_value
            row.update(value if isinstance(value, dict) else {})
        else:
            row["status"] = f"failed: {type(job_return._return_value).__name__}"
        self.rows.append(row)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        if not self.rows:
            return
        table = format_table(self.rows)
        print(f"\nsweep: {len(self.rows)} job(s)\n{table}", flush=True)
        folder = config.hydra.sweep.dir
        if folder and os.path.isdir(folder):
            with open(os.path.join(folder, "sweep_table.md"), "w") as f:
                f.write(table + "\n")
            with open(os.path.join(folder, "sweep_table.json"), "w") as f:
                json.dump(self.rows, f, indent=1)
