"""LearningRateMonitor and ThroughputMonitor: metrics about the run itself, sent to the loggers."""
from __future__ import annotations

import time
import warnings

from ...ops.peak import peak_flops
from ...trainer.errors import ConfigError
from ..base import Callback
from .flops import compute_dtype


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
            raise ConfigError("logging_interval should be `step` or `epoch` or `None`.")
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        #: the last momentum / weight decay logged per name (``<name>-momentum``), None before any
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.loggers:
            raise ConfigError("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger.")
        named = self._named(trainer)
        if self.log_momentum and any(not ({"momentum", "betas"} & set(opt.defaults)) for opt, _, _ in named):
            warnings.warn("You have set log_momentum=True, but some optimizers do not have momentum. This will "
                          "log a value 0 for the momentum.", RuntimeWarning)
        names = [name for _, group_names, _ in named for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.logging_interval != "epoch" and trainer.metrics_connector.step_row_due():
            self._emit(trainer, "step" if self.logging_interval is None else "any")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.logging_interval != "step":
            self._emit(trainer, "epoch" if self.logging_interval is None else "any")

    @staticmethod
    def _named(trainer) -> list[tuple[object, list[str], str | None]]:
        """(optimizer, a name per param group, its scheduler's interval or None), schedulers'
        optimizers first. An optimizer class's n-th occurrence is suffixed ``-(n-1)``; a
        scheduler named by its dict keeps its name and is not counted. Two param groups of one
        optimizer with the same name are Lightning's error."""
        out, counts = [], {}
        configs = [(c.scheduler.optimizer, c.name, c.interval) for c in trainer.lr_scheduler_configs]
        rest = [(o, None, None) for o in trainer.optimizers if not any(o is c[0] for c in configs)]
        for opt, given, interval in configs + rest:
            cls = type(opt)
            if given is None:
                counts[cls] = counts.get(cls, 0) + 1
            name = given or f"lr-{cls.__name__}"
            groups = opt.param_groups
            default = [g.get("name", f"pg{i}") for i, g in enumerate(groups, start=1)]
            duplicated = {n for n in default if default.count(n) > 1}
            if duplicated:
                raise ConfigError("A single `Optimizer` cannot have multiple parameter groups with identical `name` "
                                  f"values. {name} has duplicated parameter group names {duplicated}")
            if counts.get(cls, 0) > 1:
                name += f"-{counts[cls] - 1}"
            labels = default if len(groups) > 1 else [g.get("name") for g in groups]
            out.append((opt, [f"{name}/{label}" if label else name for label in labels], interval))
        return out

    def _emit(self, trainer, interval: str) -> None:
        metrics = {}
        for opt, names, sched_interval in self._named(trainer):
            if sched_interval is not None and interval not in (sched_interval, "any"):
                continue
            betas = "betas" in opt.defaults
            for g, name in zip(opt.param_groups, names):
                self._regrouped(name)
                metrics[name] = float(g["lr"])
                self.lrs.setdefault(name, []).append(metrics[name])
                if self.log_momentum:
                    value = float(g["betas"][0] if betas else g.get("momentum", 0))
                    metrics[f"{name}-momentum"] = self.last_momentum_values[f"{name}-momentum"] = value
                if self.log_weight_decay:
                    value = float(g["weight_decay"])
                    metrics[f"{name}-weight_decay"] = self.last_weight_decay_values[f"{name}-weight_decay"] = value
        trainer.metrics_connector.emit(metrics, callback=True)

    def _regrouped(self, name: str) -> None:
        """An optimizer that gained param groups (``BaseFinetuning``): its values logged so far
        under ``lr-X`` continue under ``lr-X/pg1``, as Lightning's."""
        if name.endswith("/pg1") and name not in self.lrs and name[:-4] in self.lrs:
            self.lrs[name] = self.lrs.pop(name[:-4])


class ThroughputMonitor(Callback):
    """Samples/s and tokens/s over the whole job, and model FLOPs utilisation when the module
    reports ``flops_per_sample()``, against ``peak_flops`` per process (None: the machine's peak for
    the precision's compute dtype, ``ops/peak.py``, taken at the start of fit; 0: no MFU)."""

    def __init__(self, peak_flops: float | None = None, window: int = 10) -> None:
        self.peak_flops, self.window = peak_flops, window
        self._t = None
        self._samples = 0
        self.last: dict[str, float] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.peak_flops is None and pl_module.flops_per_sample():
            self.peak_flops = peak_flops(trainer.strategy.device, compute_dtype(trainer.precision_plugin),
                                         store=trainer.world_size == 1)  # a job's ranks probe at once: not cached

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t is None:
            self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bs = _batch_size(batch)
        self._samples += bs * trainer.strategy.data_parallel_world_size
        if trainer.global_step == 0 or trainer.global_step % self.window or self._t is None:
            return
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        dt = time.perf_counter() - self._t
        m = {"throughput/samples_per_sec": self._samples / dt}
        tps = pl_module.tokens_per_sample()
        if tps:
            m["throughput/tokens_per_sec"] = m["throughput/samples_per_sec"] * tps
        fps = pl_module.flops_per_sample()
        if fps and self.peak_flops:
            m["throughput/mfu"] = m["throughput/samples_per_sec"] * fps / (self.peak_flops * trainer.world_size)
        self.last = m
        trainer.metrics_connector.emit(m)
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
