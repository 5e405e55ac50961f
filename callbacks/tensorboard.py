"""TensorBoard logging through torch.utils.tensorboard (real event files)."""
from __future__ import annotations

from typing import Any

from .base import Logger, version_dir


class TensorBoardLogger(Logger):
    def __init__(self, save_dir: str, name: str = "", version: int | str | None = None) -> None:
        self.save_dir, self.name = save_dir, name
        self._version = version
        self._writer = None

    @property
    def log_dir(self) -> str:
        path, self._version = version_dir(self.save_dir, self.name, self._version)
        return path

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(params.items()))
        self.writer.add_text("hparams", text)

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
