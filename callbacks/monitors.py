"""LearningRateMonitor and ThroughputMonitor: metrics about the run itself, sent to the loggers."""
from __future__ import annotations

import time

from .base import Callback


class LearningRateMonitor(Callback):
    """Logs each optimizer's learning rate after each optimizer step (or epoch), under
    Lightning's names: ``lr-<OptimizerClass>``, ``-1``, ``-2``... for further optimizers of the
    same class, ``/<group name>`` or ``/pg<i>`` per param group when there are several."""

    def __init__(self, logging_interval: str = "step") -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"LearningRateMonitor: logging_interval={logging_interval!r}; valid: step, epoch")
        self.logging_interval = logging_interval

    def _emit(self, trainer) -> None:
        metrics, seen = {}, {}
        for opt in trainer.optimizers:
            cls = type(opt).__name__
            seen[cls] = seen.get(cls, 0) + 1
            name = f"lr-{cls}" + (f"-{seen[cls] - 1}" if seen[cls] > 1 else "")
            groups = opt.param_groups
            for i, g in enumerate(groups):
                label = g.get("name", f"pg{i + 1}") if len(groups) > 1 else g.get("name")
                metrics[f"{name}/{label}" if label else name] = float(g["lr"])
        trainer._emit(metrics)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.logging_interval == "step" and trainer.global_step % trainer.log_every_n_steps == 0:
            self._emit(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.logging_interval == "epoch":
            self._emit(trainer)


class ThroughputMonitor(Callback):
    """Samples/s and tokens/s over the whole job, and model FLOPs utilisation when the module
    reports ``flops_per_sample()`` and ``peak_flops`` (per process) is given."""

    def __init__(self, peak_flops: float | None = None, window: int = 10) -> None:
        self.peak_flops, self.window = peak_flops, window
        self._t = None
        self._samples = 0
        self.last: dict[str, float] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self._t is None:
            self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        bs = _batch_size(batch)
        self._samples += bs * trainer.strategy.data_parallel_world_size
        if trainer.global_step == 0 or trainer.global_step % self.window or self._t is None:
            return
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        dt = time.perf_counter() - self._t
        m = {"throughput/samples_per_sec": self._samples / dt}
        tps = module.tokens_per_sample()
        if tps:
            m["throughput/tokens_per_sec"] = m["throughput/samples_per_sec"] * tps
        fps = module.flops_per_sample()
        if fps and self.peak_flops:
            m["throughput/mfu"] = m["throughput/samples_per_sec"] * fps / (self.peak_flops * trainer.world_size)
        self.last = m
        trainer._emit(m)
        self._t, self._samples = time.perf_counter(), 0


def _batch_size(batch) -> int:
    import torch

    if torch.is_tensor(batch):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return 1
