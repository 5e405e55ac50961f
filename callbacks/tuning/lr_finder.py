"""Lightning's learning-rate range test (``lightning.pytorch.tuner.lr_finder`` and the
``LearningRateFinder`` callback): inside ``on_fit_start`` the state is saved (``trainer.save_checkpoint``),
the optimizer's learning rate climbs from ``min_lr`` to ``max_lr`` over ``num_training`` steps of
the running fit (``trainer.fit_loop.run()``, the only callback then being the recorder), the
smoothed loss of each step is kept, and the search ends early once that loss passes
``early_stop_threshold`` times the best. Then everything is put back: callbacks, loggers, limits,
schedulers, and from the checkpoint the weights, optimizer state and loop counters; the
suggestion is the learning rate where the loss falls fastest."""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ...trainer.checkpoint import protocol as checkpointing
from ...trainer.errors import MisconfigurationException
from ...trainer.optim.optimizer_config import LRSchedulerConfig
from ...trainer.utilities import isolate_rng, rank_zero_warn
from ..base import Callback, DummyLogger
from .attrs import lightning_hasattr, lightning_setattr

log = logging.getLogger("zerotrain")


def _determine_lr_attr_name(model: Any, attr_name: str = "") -> str:
    """``attr_name`` if given (it must exist), else ``lr`` or ``learning_rate``, where Lightning looks."""
    if attr_name:
        if not lightning_hasattr(model, attr_name):
            raise AttributeError(f"The attribute name for the learning rate was set to {attr_name}, but could not "
                                 "find this as a field in `model` or `model.hparams`.")
        return attr_name
    for name in ("lr", "learning_rate"):
        if lightning_hasattr(model, name):
            return name
    raise AttributeError("When using the learning rate finder, either `model` or `model.hparams` should have one of "
                         "these fields: ('lr', 'learning_rate'). If your model has a different name for the learning "
                         "rate, set it with `.lr_find(attr_name=...)`.")


class _SearchLR(LRScheduler):
    """Step ``i`` of ``num_iter`` sets each group's rate a fraction ``(i + 1) / num_iter`` of the
    way from its start to ``end_lr`` (``_at``); ``lr`` is the list last set."""

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1):
        self.end_lr, self.num_iter = end_lr, num_iter
        super().__init__(optimizer, last_epoch)

    def _at(self, base_lr: float, r: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        self._lr = [self._at(b, r) for b in self.base_lrs] if self.last_epoch > 0 else list(self.base_lrs)
        return self._lr

    @property
    def lr(self) -> list[float]:
        return self._lr


class _LinearLR(_SearchLR):
    def _at(self, base_lr: float, r: float) -> float:
        return base_lr + r * (self.end_lr - base_lr)


class _ExponentialLR(_SearchLR):
    def _at(self, base_lr: float, r: float) -> float:
        return base_lr * (self.end_lr / base_lr) ** r


class _LRFinder:
    """The result of a search: ``results["lr"]`` and ``results["loss"]`` (smoothed), ``suggestion()``
    and ``plot()``."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        assert mode in ("linear", "exponential"), "mode should be either `linear` or `exponential`"
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, Any] = {}
        self._total_batch_idx = 0
        self._optimal_idx: int | None = None

    def _exchange_scheduler(self, trainer: Any) -> None:
        """The one optimizer starts at ``lr_min``; the search's scheduler, stepped every step, is
        the only one."""
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise MisconfigurationException(f"`model.configure_optimizers()` returned {len(optimizers)}, but learning "
                                            "rate finder only works with single optimizer")
        optimizer = optimizers[0]
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.lr_min
        kind = _LinearLR if self.mode == "linear" else _ExponentialLR
        configs = trainer.lr_scheduler_configs
        configs.clear()
        configs.append(LRSchedulerConfig(kind(optimizer, self.lr_max, self.num_training), interval="step"))

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        try:
            import matplotlib.pyplot as plt
        except ImportError:
            raise MisconfigurationException("To use the `plot` method, you must have Matplotlib installed. Install it "
                                            "by running `pip install -U matplotlib`.") from None
        fig, ax = plt.subplots() if ax is None else (ax.figure, ax)
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx:
            i = self._optimal_idx
            ax.plot(self.results["lr"][i], self.results["loss"][i], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate at the steepest descent of the loss (``torch.gradient`` of the finite
        losses over their learning rates, the first ``skip_begin`` and last ``skip_end`` left out);
        None, said as an error, with fewer than two such points."""
        kept = slice(skip_begin, -skip_end)
        losses, lrs = torch.tensor(self.results["loss"][kept]), torch.tensor(self.results["lr"][kept])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            log.error("Failed to compute suggestion for learning rate because there are not enough points. Increase "
                      "the loop iteration limits or the size of your dataset/dataloader.")
            self._optimal_idx = None
            return None
        steepest = int(torch.argmin(torch.gradient(losses, spacing=[lrs])[0]).item())
        positions = torch.arange(len(self.results["loss"]))[kept][finite]
        self._optimal_idx = int(positions[steepest].item())
        return self.results["lr"][self._optimal_idx]


class _LRCallback(Callback):
    """The search's only callback: the learning rate before each step, the smoothed loss after it
    (``beta``: the running average's memory), and the stop once it diverges."""

    def __init__(self, num_training: int, early_stop_threshold: float | None = 4.0,
                 progress_bar_refresh_rate: int = 0, beta: float = 0.98) -> None:
        self.num_training, self.early_stop_threshold, self.beta = num_training, early_stop_threshold, beta
        self.progress_bar_refresh_rate, self.progress_bar = progress_bar_refresh_rate, None
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.avg_loss = self.best_loss = 0.0

    @staticmethod
    def _steps_here(trainer: Any) -> bool:
        return (trainer.fit_loop.batch_idx + 1) % trainer.accumulate_grad_batches == 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._steps_here(trainer):
            self.lrs.append(trainer.lr_scheduler_configs[0].scheduler.lr[0])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._steps_here(trainer):
            return
        if not outputs:  # the step returned None: a loss that the suggestion skips
            self.losses.append(float("nan"))
            return
        loss = float((outputs if torch.is_tensor(outputs) else outputs["loss"]).item())
        step = trainer.global_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * loss
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        if self.early_stop_threshold is not None and step > 1 and smoothed > self.early_stop_threshold * self.best_loss:
            trainer.should_stop = True
        trainer.should_stop = trainer.strategy.broadcast(trainer.should_stop)
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)


def _dump_params(trainer: Any) -> dict[str, Any]:
    return {"lr_scheduler_configs": list(trainer.lr_scheduler_configs), "callbacks": list(trainer.callbacks),
            "loggers": list(trainer.loggers), "max_steps": trainer.fit_loop.max_steps,
            "limit_val_batches": trainer.limit_val_batches}


def _use_callbacks(trainer: Any, callbacks: list) -> None:
    trainer.callbacks = trainer.hooks.callbacks = list(callbacks)


def _restore_params(trainer: Any, params: dict[str, Any]) -> None:
    configs = trainer.lr_scheduler_configs
    configs[:] = params["lr_scheduler_configs"]
    _use_callbacks(trainer, params["callbacks"])
    trainer.loggers = params["loggers"]
    trainer.fit_loop.max_steps = params["max_steps"]
    trainer.limit_val_batches = params["limit_val_batches"]
    trainer.should_stop = False


def _remove_checkpoint(trainer: Any, path: str) -> None:
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    trainer.strategy.barrier()


def _lr_find(trainer: Any, model: Any, min_lr: float = 1e-8, max_lr: float = 1, num_training: int = 100,
             mode: str = "exponential", early_stop_threshold: float | None = 4.0, update_attr: bool = False,
             attr_name: str = "") -> _LRFinder | None:
    """The search (see the module's docstring), inside the running fit; returns its result (None
    under ``fast_dev_run``) and with ``update_attr`` sets the suggestion on the module's ``lr``
    attribute and the optimizer."""
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")
        return None
    if update_attr:
        attr_name = _determine_lr_attr_name(model, attr_name)
    path = trainer.strategy.broadcast(os.path.join(trainer.default_root_dir, f".lr_find_{uuid.uuid4()}.ckpt"))
    trainer.save_checkpoint(path)
    start_steps = trainer.global_step
    params = _dump_params(trainer)
    recorder = _LRCallback(num_training, early_stop_threshold, progress_bar_refresh_rate=1)
    _use_callbacks(trainer, [recorder])
    trainer.loggers = [DummyLogger()] if trainer.loggers else []
    trainer.fit_loop.max_steps = num_training + trainer.global_step
    trainer.limit_val_batches = num_training
    finder = _LRFinder(mode, min_lr, max_lr, num_training)
    finished = False
    try:
        finder._exchange_scheduler(trainer)
        trainer.fit_loop.run()
        if trainer.global_step != num_training + start_steps:
            log.info("LR finder stopped early after %d steps due to diverging loss.", trainer.global_step)
        finder.results.update({"lr": recorder.lrs, "loss": recorder.losses})
        finder._total_batch_idx = trainer.fit_loop.total_batch_idx
        finished = True
    finally:
        _restore_params(trainer, params)
        trainer.fit_loop.setup_data()  # the training loader requested again, as Lightning's (before the
        checkpointing.load(trainer, path)  # load puts the RNG back); the weights, optimizer state, loop counters
        _remove_checkpoint(trainer, path)
    finder.results = trainer.strategy.broadcast(finder.results)
    if update_attr:
        lr = finder.suggestion()
        if lr is not None:
            lightning_setattr(model, attr_name, lr)
            for opt in trainer.optimizers:
                for group in opt.param_groups:
                    group["lr"] = lr
            log.info("Learning rate set to %s", lr)
    return finder


class LearningRateFinder(Callback):
    """As Lightning 2.6's: the range test runs in ``on_fit_start`` (``lr_find``), the result in
    ``optimal_lr``; ``Tuner.lr_find`` uses it and ends the fit right after (``_early_exit``)."""

    SUPPORTED_MODES = ("linear", "exponential")

    def __init__(self, min_lr: float = 1e-8, max_lr: float = 1, num_training_steps: int = 100,
                 mode: str = "exponential", early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                 attr_name: str = "") -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"`mode` should be either of {self.SUPPORTED_MODES}")
        self._min_lr, self._max_lr, self._num_training_steps = min_lr, max_lr, num_training_steps
        self._mode, self._early_stop_threshold = mode, early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        self._early_exit = False
        self.optimal_lr: _LRFinder | None = None

    def lr_find(self, trainer: Any, pl_module: Any) -> None:
        with isolate_rng():
            self.optimal_lr = _lr_find(trainer, pl_module, min_lr=self._min_lr, max_lr=self._max_lr,
                                       num_training=self._num_training_steps, mode=self._mode,
                                       early_stop_threshold=self._early_stop_threshold,
                                       update_attr=self._update_attr, attr_name=self._attr_name)
        if self._early_exit:
            from .tuner import exit_fit

            exit_fit(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.lr_find(trainer, pl_module)
