"""Lightning's small training-time callbacks: ``GradientAccumulationScheduler`` (the accumulation
factor per epoch), ``OnExceptionCheckpoint`` (a checkpoint when fit fails) and
``DeviceStatsMonitor`` (the device's memory / utilisation numbers to the loggers)."""
from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

from ..trainer.errors import ConfigError
from .base import Callback


class GradientAccumulationScheduler(Callback):
    """``scheduling``: ``{epoch: accumulate_grad_batches}`` from that epoch on (epoch 0 gets 1
    unless given), set on the Trainer at each training epoch's start. As Lightning: refused with
    manual optimization or with ``Trainer(accumulate_grad_batches != 1)``."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling:
            raise TypeError("Empty dict cannot be interpreted correct")
        if any(not isinstance(k, int) or k < 0 for k in scheduling):
            raise ConfigError(f"Epoch should be an int greater than or equal to 0. Got {list(scheduling.keys())}.")
        if any(not isinstance(v, int) or v < 1 for v in scheduling.values()):
            raise ConfigError(f"Accumulation factor should be an int greater than 0. Got {list(scheduling.values())}.")
        if 0 not in scheduling:
            scheduling.update({0: 1})
        self.scheduling = scheduling
        self.epochs = sorted(scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from ..trainer.utilities import is_overridden

        if not pl_module.automatic_optimization:
            raise RuntimeError("Automatic gradient accumulation and the `GradientAccumulationScheduler` is not "
                               "supported for manual optimization. Please remove the callback or switch to automatic "
                               "optimization.")
        if self.going_to_accumulate_grad_batches() and (is_overridden("optimizer_step", pl_module)
                                                         or is_overridden("optimizer_zero_grad", pl_module)):
            warnings.warn("When using `Trainer(accumulate_grad_batches != 1)` and overriding "
                          "`LightningModule.optimizer_{step,zero_grad}`, the hooks will not be called on every batch "
                          "(rather, they are called on every optimization step).", stacklevel=2)
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler`"
                             " callback. Either remove `accumulate_grad_batches` from the Trainer or remove the "
                             "callback.")

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        trainer.accumulate_grad_batches = 1  # the Trainer's own value (on_train_start refused any other)


class OnExceptionCheckpoint(Callback):
    """``OnExceptionCheckpoint(dirpath, filename="on_exception")``: when an exception ends fit,
    every rank saves ``dirpath/<filename>.ckpt`` (a checkpoint directory, replacing one there);
    resume with ``fit(ckpt_path=cb.ckpt_path)``. A fit that ends well removes it, as Lightning's."""

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: "str | os.PathLike", filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("The filename cannot be empty")
        self.dirpath, self.filename = os.fspath(dirpath), filename
        self._failed = False

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._failed = True
        if trainer.is_global_zero:
            _remove(self.ckpt_path)
        trainer.strategy.barrier()
        trainer.save_checkpoint(self.ckpt_path, update_latest=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and not self._failed and trainer.is_global_zero:
            _remove(self.ckpt_path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


class DeviceStatsMonitor(Callback):
    """Lightning's: at each training batch's start and end, on logging steps (``log_every_n_steps``),
    the device's statistics to every logger, named ``DeviceStatsMonitor.on_train_batch_start/<stat>``:
    ``torch.cuda.memory_stats`` on a GPU; on the CPU ``cpu_percent``, ``cpu_vm_percent`` and
    ``cpu_swap_percent`` (psutil), which ``cpu_stats=True`` adds on a GPU and ``False`` turns off."""

    def __init__(self, cpu_stats: bool | None = None) -> None:
        self._cpu_stats = cpu_stats

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise ConfigError("Cannot use `DeviceStatsMonitor` callback with `Trainer(logger=False)`.")
        if self._cpu_stats is not False and trainer.strategy.device.type == "cpu":
            try:
                import psutil  # noqa: F401
            except ImportError as exc:
                raise ModuleNotFoundError("`DeviceStatsMonitor` cannot log CPU stats as `psutil` is not installed. "
                                          "Run `pip install psutil` or pass cpu_stats=False.") from exc

    def _log(self, trainer: Any, key: str) -> None:
        logging = getattr(trainer, "metrics_connector", None)
        if logging is not None and not logging.step_row_due():
            return
        device = trainer.strategy.device
        if self._cpu_stats is False and device.type == "cpu":
            return
        stats: dict[str, float] = {}
        if device.type == "cuda":
            import torch

            stats.update(torch.cuda.memory_stats(device))
        if device.type == "cpu" or self._cpu_stats:
            stats.update(cpu_stats())
        step = logging.logging_step if logging is not None else trainer.global_step
        for lg in trainer.loggers:
            sep = getattr(lg, "group_separator", "/")
            lg.log_metrics({f"{type(self).__qualname__}.{key}{sep}{k}": v for k, v in stats.items()}, step=step)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_start")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_end")


def cpu_stats() -> dict[str, float]:
    import psutil

    return {"cpu_vm_percent": psutil.virtual_memory().percent, "cpu_percent": psutil.cpu_percent(),
            "cpu_swap_percent": psutil.swap_memory().percent}
