"""Lightning's ``StochasticWeightAveraging`` callback: from ``swa_epoch_start`` on, each training
epoch's start folds the module's weights into a running average held in a copy of the module
(torch's SWA rule, ``torch.optim.swa_utils.get_swa_avg_fn``; the copy is made without the Trainer)
while ``torch.optim.swa_utils.SWALR`` takes over the learning rate; the average becomes the
module's weights when training ends. A module with batch-norm layers
gets one more epoch of forwards only (``trainer.fit_loop.skip_backward``), whose batches recompute
the running statistics of the averaged weights.

Where it runs: every strategy that holds each parameter whole on every rank (single, ddp, zero1/2
and offload at those stages); zero1/2 keep fp32 masters besides the module's parameters, so the
averaged weights are written into them too (``write_back``), as a later checkpoint or step reads them.
ZeRO-3 (each rank holds a shard of each parameter) and the pipeline (each rank a stage) are refused
at set-up, as Lightning refuses FSDP and DeepSpeed."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, get_swa_avg_fn

from ...trainer.errors import MisconfigurationException
from ...trainer.optim.optimizer_config import LRSchedulerConfig
from ...trainer.utilities import rank_zero_info, rank_zero_warn
from ..base import Callback
from .write_back import write_back

AvgFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


class StochasticWeightAveraging(Callback):
    """As Lightning 2.6: ``swa_lrs`` (a positive float, or one per param group), ``swa_epoch_start``
    (an epoch counted from 1, or a fraction of ``max_epochs``), ``annealing_epochs`` and
    ``annealing_strategy`` (``"cos"`` or ``"linear"``, SWALR's), ``avg_fn`` (``(averaged, current,
    n_averaged) -> new averaged``) and ``device`` (where the average lives; None: the module's)."""

    def __init__(self, swa_lrs: float | list[float], swa_epoch_start: int | float = 0.8,
                 annealing_epochs: int = 10, annealing_strategy: str = "cos", avg_fn: AvgFn | None = None,
                 device: torch.device | str | None = torch.device("cpu")) -> None:
        bad_start = (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) or (
            isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1)
        if bad_start:
            raise MisconfigurationException("swa_epoch_start should be a >0 integer or a float between 0 and 1.")
        lrs_ok = (isinstance(swa_lrs, float) and swa_lrs > 0) or (
            isinstance(swa_lrs, list) and all(isinstance(lr, float) and lr > 0 for lr in swa_lrs))
        if not lrs_ok:
            raise MisconfigurationException("The `swa_lrs` should a positive float, or a list of positive floats")
        if avg_fn is not None and not callable(avg_fn):
            raise MisconfigurationException("The `avg_fn` should be callable.")
        if device is not None and not isinstance(device, (torch.device, str)):
            raise MisconfigurationException(f"device is expected to be a torch.device or a str. Found {device}")
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._model_contains_batch_norm: bool | None = None
        self._average_model: nn.Module | None = None
        self.n_averaged: torch.Tensor | None = None
        self._initialized = False
        self._swa_scheduler: SWALR | None = None
        self._scheduler_state: dict | None = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self._accumulate_grad_batches = 1
        self._max_epochs = -1
        self.momenta: dict[nn.Module, float | None] = {}

    # ------------------------------------------------------------------ Lightning's public names
    @property
    def swa_start(self) -> int:
        return max(int(self._swa_epoch_start) - 1, 0)  # 0-based

    @property
    def swa_end(self) -> float:
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1  # 0-based

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: nn.Module) -> bool:
        return any(_is_batch_norm(m) for m in pl_module.modules())

    #: the running mean: the average moved ``1 / (n + 1)`` of the way to the new weights (torch's)
    avg_fn = staticmethod(get_swa_avg_fn())

    @staticmethod
    def update_parameters(average_model: nn.Module, model: nn.Module, n_averaged: torch.Tensor,
                          avg_fn: AvgFn) -> None:
        """Fold ``model``'s parameters into ``average_model`` (the first time: a copy); ``n_averaged`` + 1."""
        with torch.no_grad():
            for avg, cur in zip(average_model.parameters(), model.parameters()):
                cur = cur.detach().to(avg.device)
                avg.detach().copy_(cur if n_averaged == 0 else avg_fn(avg.detach(), cur, n_averaged.to(avg.device)))
        n_averaged += 1

    @staticmethod
    def transfer_weights(src_pl_module: nn.Module, dst_pl_module: nn.Module) -> None:
        with torch.no_grad():
            for src, dst in zip(src_pl_module.parameters(), dst_pl_module.parameters()):
                dst.detach().copy_(src.to(dst.device))

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        s = trainer.strategy
        if getattr(s, "stage", 0) >= 3 or s.runs_own_schedule:
            raise MisconfigurationException(
                f"StochasticWeightAveraging: strategy={s.name!r} does not hold each parameter whole on every rank "
                "(SWA does not currently support sharded models); valid: single, ddp, zero1, zero2 (offload at "
                "stage 1/2)")
        # the copy is made before the strategy lays the module out, as Lightning's before it moves it,
        # and without the Trainer (its loaders and datamodule are not copied)
        pl_module.trainer = None
        try:
            self._average_model = copy.deepcopy(pl_module)
        finally:
            pl_module.trainer = trainer

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException("SWA currently works with 1 `optimizer`.")
        if len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationException("SWA currently not supported for more than 1 `lr_scheduler`.")
        max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs
        if isinstance(self._swa_epoch_start, float):
            if max_epochs == -1:
                raise MisconfigurationException(
                    "SWA with `swa_epoch_start` as a float is not supported when `max_epochs=-1`. "
                    "Please provide `swa_epoch_start` as an integer.")
            self._swa_epoch_start = int(max_epochs * self._swa_epoch_start)
        self._model_contains_batch_norm = self.pl_module_contains_batch_norm(pl_module)
        self._max_epochs = max_epochs
        if self._model_contains_batch_norm and max_epochs != -1:
            trainer.fit_loop.max_epochs += 1  # one more epoch: the batch-norm statistics of the average
        if self._scheduler_state is not None and trainer.lr_scheduler_configs:
            trainer.lr_scheduler_configs.clear()  # resumed: SWALR comes back at its epoch with its saved state

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        epoch = trainer.current_epoch
        if not self._initialized and self.swa_start <= epoch <= self.swa_end:
            self._start_averaging(trainer, pl_module)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            self.update_parameters(self._average_model, pl_module, self.n_averaged, self._avg_fn)
            self._latest_update_epoch = epoch
        if self._max_epochs != -1 and epoch == self.swa_end + 1:  # the batch-norm epoch
            self._load_average(trainer, pl_module)
            self.reset_batch_norm_and_save_state(pl_module)
            trainer.fit_loop.max_batches += 1
            trainer.fit_loop.skip_backward = True
            self._accumulate_grad_batches = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = trainer.fit_loop.max_batches  # no optimizer step in it

    def _start_averaging(self, trainer: Any, pl_module: Any) -> None:
        self._initialized = True
        self._average_model = self._average_model.to(self._device or pl_module.device)
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(optimizer, swa_lr=self._swa_lrs, anneal_epochs=self._annealing_epochs,
                                    anneal_strategy=self._annealing_strategy,
                                    last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1)
        if self._scheduler_state is not None:
            self._swa_scheduler.load_state_dict(self._scheduler_state)
        elif trainer.current_epoch != self.swa_start:
            rank_zero_warn("SWA is initializing after swa_start without any checkpoint data. "
                           "This may be caused by loading a checkpoint from an older version of PyTorch Lightning.")
        config = LRSchedulerConfig(self._swa_scheduler)  # once per epoch
        configs = trainer.lr_scheduler_configs
        if configs:
            old = configs[0]
            if old.interval != "epoch" or old.frequency != 1:
                rank_zero_warn(f"SWA is currently only supported every epoch. Found {old}")
            rank_zero_info(f"Swapping scheduler `{type(old.scheduler).__name__}` for `{type(self._swa_scheduler).__name__}`")
            configs[0] = config
        else:
            configs.append(config)
        if self.n_averaged is None:
            self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long, device=pl_module.device)

    def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
        trainer.fit_loop.skip_backward = False

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        ended = trainer.current_epoch - 1  # the epoch counter moved on before this hook
        if self._model_contains_batch_norm and self._max_epochs != -1 and ended == self.swa_end + 1:
            trainer.accumulate_grad_batches = self._accumulate_grad_batches
            trainer.fit_loop.max_batches -= 1
            trainer.fit_loop.max_epochs -= 1
            self.reset_momenta()
            write_back(trainer.strategy, pl_module)  # the recomputed statistics' weights, into the masters
        elif ended == self.swa_end or self._max_epochs == -1:
            if self._average_model is not None and self._initialized:
                self._load_average(trainer, pl_module)

    def _load_average(self, trainer: Any, pl_module: Any) -> None:
        self.transfer_weights(self._average_model, pl_module)
        write_back(trainer.strategy, pl_module)

    # ------------------------------------------------------------------ batch norm
    def reset_batch_norm_and_save_state(self, pl_module: nn.Module) -> None:
        """Each batch-norm layer starts its statistics over, as a cumulative mean (momentum None)."""
        self.momenta = {}
        for m in filter(_is_batch_norm, pl_module.modules()):
            m.running_mean = torch.zeros_like(m.running_mean)
            m.running_var = torch.ones_like(m.running_var)
            self.momenta[m] = m.momentum
            m.momentum = None
            m.num_batches_tracked *= 0

    def reset_momenta(self) -> None:
        for m, momentum in self.momenta.items():
            m.momentum = momentum

    # ------------------------------------------------------------------ checkpoint
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Resuming after SWA began: the saved scheduler state is SWALR's, which this callback
        restores itself when its epoch comes; the configured schedulers leave before the Trainer
        loads scheduler states (Lightning clears them at fit start, before its own load)."""
        if self._scheduler_state is not None and trainer.lr_scheduler_configs:
            trainer.lr_scheduler_configs.clear()

    def state_dict(self) -> dict[str, Any]:
        n, avg = self.n_averaged, self._average_model
        return {"n_averaged": 0 if n is None else int(n.item()),
                "latest_update_epoch": self._latest_update_epoch,
                "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
                "average_model_state": None if avg is None else dict(avg.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_n_averaged = state_dict["n_averaged"]
        self._latest_update_epoch = state_dict["latest_update_epoch"]
        self._scheduler_state = state_dict["scheduler_state"]
        if self._average_model is not None and state_dict["average_model_state"] is not None:
            self._average_model.load_state_dict(state_dict["average_model_state"])
