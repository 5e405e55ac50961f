"""TensorBoard logging through torch.utils.tensorboard (real event files)."""
from __future__ import annotations

import os
from typing import Any

from .base import Logger


class TensorBoardLogger(Logger):
    def __init__(self, save_dir: str, name: str = "", version: int | str | None = None) -> None:
        self.save_dir, self.name = save_dir, name
        self._version = version
        self._writer = None

    @property
    def log_dir(self) -> str:
        root = os.path.join(self.save_dir, self.name)
        if self._version is None:
            existing = [d for d in os.listdir(root) if d.startswith("version_")] if os.path.isdir(root) else []
            nums = [int(d.split("_")[1]) for d in existing if d.split("_")[1].isdigit()]
            self._version = max(nums, default=-1) + 1
        v = self._version if isinstance(self._version, str) else f"version_{self._version}"
        return os.path.join(root, v)

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
