"""CSVLogger in Lightning's layout (``<save_dir>/<name>/version_<n>/metrics.csv`` and
``hparams.yaml``), and the names ``zerotrain.loggers`` exports (Lightning's ``lightning.pytorch.loggers``)."""
from __future__ import annotations

import csv
import os
from typing import Any

from .base import Logger, VersionedLogger, rank_zero_experiment
from .tensorboard import TensorBoardLogger


class CSVLogger(VersionedLogger):
    """Metrics as rows of ``metrics.csv`` (one per ``log_metrics`` call, with its ``step``; the
    header is every name seen so far, sorted, so a file read back by ``csv.DictReader`` has one
    column per metric as Lightning's has) and hyperparameters as ``hparams.yaml``. Rows are
    buffered and written every ``flush_logs_every_n_steps`` calls and at the end of fit."""

    METRICS_FILE, HPARAMS_FILE = "metrics.csv", "hparams.yaml"

    def __init__(self, save_dir: str, name: str = "lightning_logs", version: int | str | None = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"CSVLogger: flush_logs_every_n_steps={flush_logs_every_n_steps!r} must be >= 1")
        super().__init__(save_dir, name, version)
        self.prefix = prefix
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self.hparams: dict[str, Any] = {}

    @property
    @rank_zero_experiment
    def experiment(self) -> "CSVLogger":
        """Lightning's is its CSV writer (``log_metrics``, ``log_hparams``, ``save``); here the
        logger itself plays that part."""
        return self

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {f"{self.prefix}-{k}" if self.prefix else k: _scalar(v) for k, v in metrics.items()}
        row["step"] = step if step is not None else len(self._rows)
        self._rows.append(row)
        if len(self._rows) % self.flush_logs_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.hparams.update(params if isinstance(params, dict) else vars(params))
        self._write_hparams()

    log_hparams = log_hyperparams  # the name on Lightning's CSV writer (its ``experiment``)

    def save(self) -> None:
        """Append the buffered rows; a metric name not seen before rewrites the file with the
        wider header (earlier rows get empty cells in the new columns)."""
        if not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, self.METRICS_FILE)
        new = sorted({k for r in self._rows for k in r} - set(self._keys))
        rows, self._rows = self._rows, []
        exists = os.path.isfile(path)
        if new:
            self._keys = sorted([*self._keys, *new])
            if exists:
                with open(path, newline="") as f:
                    rows = list(csv.DictReader(f)) + rows
                exists = False
        with open(path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            if not exists:
                writer.writeheader()
            writer.writerows(rows)

    def finalize(self, status: str = "success") -> None:
        self.save()
        self._write_hparams()

    def _write_hparams(self) -> None:
        import yaml

        os.makedirs(self.log_dir, exist_ok=True)
        plain = {k: v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else repr(v)
                 for k, v in self.hparams.items()}
        with open(os.path.join(self.log_dir, self.HPARAMS_FILE), "w") as f:
            yaml.safe_dump(plain, f)


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


__all__ = ["Logger", "CSVLogger", "TensorBoardLogger"]
