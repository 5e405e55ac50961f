"""CSVLogger in Lightning's layout (``<save_dir>/<name>/version_<n>/metrics.csv`` and
``hparams.yaml``), and the names ``zerotrain.loggers`` exports (Lightning's ``lightning.pytorch.loggers``)."""
from __future__ import annotations

import csv
import os
import warnings
from typing import Any

from ...trainer.checkpoint import fs
from ..base import Logger, VersionedLogger, rank_zero_experiment
from .tensorboard import TensorBoardLogger


class ExperimentWriter:
    """Lightning's CSV writer (``CSVLogger.experiment``): rows of ``metrics.csv`` (one per
    ``log_metrics`` call, with its ``step``; the header is every name seen so far, sorted, so a file
    read back by ``csv.DictReader`` has one column per metric as Lightning's has) and
    ``hparams.yaml`` (also at each ``log_hparams``), both written by ``save``. A metric name not seen before rewrites the file
    with the wider header (earlier rows get empty cells in the new columns)."""

    NAME_METRICS_FILE, NAME_HPARAMS_FILE = "metrics.csv", "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.hparams: dict[str, Any] = {}
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        if fs.isdir(log_dir) and fs.listdir(log_dir):
            warnings.warn(f"Experiment logs directory {log_dir} exists and is not empty. Previous log files in this "
                          "directory will be deleted when the new ones are saved!", stacklevel=2)
            if fs.isfile(self.metrics_file_path):  # an earlier run's rows would mix with these
                fs.remove(self.metrics_file_path)
        fs.makedirs(log_dir)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Record ``params`` and write ``hparams.yaml`` at once, as Lightning's writer."""
        from ...trainer.api.saving import save_hparams_to_yaml

        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        row = {k: _scalar(v) for k, v in metrics_dict.items()}
        row["step"] = len(self.metrics) if step is None else step
        self.metrics.append(row)

    def save(self) -> None:
        from ...trainer.api.saving import save_hparams_to_yaml

        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
        if not self.metrics:
            return
        new = sorted({k for r in self.metrics for k in r} - set(self.metrics_keys))
        rows, self.metrics = self.metrics, []
        exists = fs.isfile(self.metrics_file_path)
        if new:
            self.metrics_keys = sorted([*self.metrics_keys, *new])
            if exists:
                with fs.open_file(self.metrics_file_path, newline="") as f:
                    rows = list(csv.DictReader(f)) + rows
                exists = False
        with fs.open_file(self.metrics_file_path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if not exists:
                writer.writeheader()
            writer.writerows(rows)


class CSVLogger(VersionedLogger):
    """``CSVLogger(save_dir, name="lightning_logs", version=None, prefix="", flush_logs_every_n_steps=100)``:
    ``<save_dir>/<name>/version_<n>/metrics.csv`` and ``hparams.yaml`` through its ``experiment``
    (an ``ExperimentWriter``), written every ``flush_logs_every_n_steps`` steps and at the end of fit."""

    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: "str | os.PathLike", name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        if flush_logs_every_n_steps < 1:
            raise ValueError(f"CSVLogger: flush_logs_every_n_steps={flush_logs_every_n_steps!r} must be >= 1")
        super().__init__(os.fspath(save_dir), name or "", version)
        self._prefix = prefix
        self._flush_logs_every_n_steps = flush_logs_every_n_steps
        self._experiment: ExperimentWriter | None = None

    prefix = property(lambda self: self._prefix)
    flush_logs_every_n_steps = property(lambda self: self._flush_logs_every_n_steps)

    @property
    def hparams(self) -> dict[str, Any]:
        return self.experiment.hparams

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """Lightning's: the CSV writer (``log_metrics``, ``log_hparams``, ``save``, ``metrics``)."""
        if self._experiment is None:
            fs.makedirs(self.root_dir)
            self._experiment = ExperimentWriter(self.log_dir)
        return self._experiment

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k: v for k, v in metrics.items()}
        if step is None:
            step = len(self.experiment.metrics)
        self.experiment.log_metrics(metrics, step)
        if (step + 1) % self._flush_logs_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: Any = None, *args: Any, **kwargs: Any) -> None:
        self.experiment.log_hparams({} if params is None else params if isinstance(params, dict) else vars(params))

    def save(self) -> None:
        self.experiment.save()

    def finalize(self, status: str = "success") -> None:
        if self._experiment is not None:
            self.save()


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


__all__ = ["Logger", "CSVLogger", "TensorBoardLogger", "ExperimentWriter"]
