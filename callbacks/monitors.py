"""LearningRateMonitor and ThroughputMonitor: metrics about the run itself, sent to the loggers."""
from __future__ import annotations

import time

from .base import Callback


class LearningRateMonitor(Callback):
    """Lightning's LearningRateMonitor: each optimizer's learning rate (and optionally momentum and
    weight decay) sent to the loggers before the optimizer step of every logging step (or at
    each epoch's start), with Lightning's names: ``lr-<OptimizerClass>``, ``-1``, ``-2``... for
    further optimizers of the same class, the scheduler dict's ``name`` where given,
    ``/<group name>`` or ``/pg<i>`` per param group when there are several. Optimizers with a
    scheduler are named first, then the others, as Lightning does.

    ``logging_interval=None`` (Lightning's default) logs a scheduler's optimizer at its scheduler's
    interval and an optimizer without a scheduler at every logging step; ``"step"`` / ``"epoch"``
    log every optimizer at that interval. The values also go to ``trainer.callback_metrics``, and
    ``self.lrs`` keeps every value logged, by name."""

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(f"LearningRateMonitor: logging_interval={logging_interval!r}; valid: None, step, epoch")
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}

    def on_train_start(self, trainer, module) -> None:
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor: the Trainer has no logger (logger=False); valid: a Trainer "
                             "with a logger")
        self.lrs = {name: [] for _, names, _ in self._named(trainer) for name in names}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.logging_interval != "epoch" and trainer._logging.step_row_due():
            self._emit(trainer, "step" if self.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer, module) -> None:
        if self.logging_interval != "step":
            self._emit(trainer, "epoch" if self.logging_interval is None else "any")

    @staticmethod
    def _named(trainer) -> list[tuple[object, list[str], str | None]]:
        """(optimizer, a name per param group, its scheduler's interval or None), schedulers'
        optimizers first. An optimizer class's n-th occurrence is suffixed ``-(n-1)``; a
        scheduler named by its dict keeps its name and is not counted."""
        out, counts = [], {}
        configs = [(c.scheduler.optimizer, c.name, c.interval) for c in trainer.lr_scheduler_configs]
        rest = [(o, None, None) for o in trainer.optimizers if not any(o is c[0] for c in configs)]
        for opt, given, interval in configs + rest:
            cls = type(opt)
            if given is None:
                counts[cls] = counts.get(cls, 0) + 1
            name = given or f"lr-{cls.__name__}"
            if counts.get(cls, 0) > 1:
                name += f"-{counts[cls] - 1}"
            groups = opt.param_groups
            labels = [g.get("name", f"pg{i + 1}") if len(groups) > 1 else g.get("name") for i, g in enumerate(groups)]
            out.append((opt, [f"{name}/{label}" if label else name for label in labels], interval))
        return out

    def _emit(self, trainer, interval: str) -> None:
        metrics = {}
        for opt, names, sched_interval in self._named(trainer):
            if sched_interval is not None and interval not in (sched_interval, "any"):
                continue
            betas = "betas" in opt.defaults
            for g, name in zip(opt.param_groups, names):
                metrics[name] = float(g["lr"])
                self.lrs.setdefault(name, []).append(metrics[name])
                if self.log_momentum:
                    metrics[f"{name}-momentum"] = float(g["betas"][0] if betas else g.get("momentum", 0))
                if self.log_weight_decay:
                    metrics[f"{name}-weight_decay"] = float(g["weight_decay"])
        trainer._emit(metrics, callback=True)


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
