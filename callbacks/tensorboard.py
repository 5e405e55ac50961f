"""TensorBoard logging through torch.utils.tensorboard (real event files)."""
from __future__ import annotations

from typing import Any

from .base import VersionedLogger, rank_zero_experiment


class TensorBoardLogger(VersionedLogger):
    def __init__(self, save_dir: str, name: str = "", version: int | str | None = None) -> None:
        super().__init__(save_dir, name, version)
        self._writer = None

    @property
    @rank_zero_experiment
    def experiment(self):
        """The SummaryWriter (Lightning's ``experiment``); a do-nothing stand-in off rank 0."""
        return self.writer

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            value = value.item() if hasattr(value, "item") else value
            if isinstance(value, dict):
                self.writer.add_scalars(name, value, global_step=step)
            else:
                self.writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        params = params if isinstance(params, dict) else vars(params)
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(params.items()))
        self.writer.add_text("hparams", text)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
