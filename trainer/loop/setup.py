"""The Trainer's set-up: connecting the processes, Lightning's ``setup``/``teardown`` hooks per
stage, and building the model and optimizers under the strategy (a mixin of
:class:`~.trainer.Trainer`, run once per Trainer by ``fit``, ``validate``, ``test`` and
``predict``)."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ..launch import job
from ..api.datamodule import DataModule
from ..errors import ConfigError
from .hooks import merge_callbacks
from ..api.hparams import clean_namespace
from ..api.module import TrainModule
from ..optim.optimization import Optimization


class TrainerSetup:
    """Set-up on the Trainer: the processes, the stage hooks, the model and its optimizers."""

    def _setup(self, module: TrainModule, stage: str = "fit", datamodule: DataModule | None = None) -> None:
        """Connect the processes, attach the data (``prepare_data``, ``setup(stage)``), then build
        the model and optimizer under the strategy. A Trainer is set up once, for one module;
        later stages only attach their data. Unpicklable hyperparameters are dropped first, with
        Lightning's warning (``hparams.clean_namespace``)."""
        if isinstance(getattr(module, "hparams", None), MutableMapping):
            clean_namespace(module.hparams)
        if self._ready:
            if module is not self.module:
                raise ConfigError(f"Trainer.{stage}: this Trainer is set up for {type(self.module).__name__} "
                                  f"(one module per Trainer); got another {type(module).__name__}: use a new "
                                  "Trainer, or model=None")
            module._trainer = self  # again: another Trainer may have been given the module since
            self._setup_data(stage, datamodule, module)
            self._stage_setup(stage)
            if stage == "fit":
                self._setup_optimizers()
            return
        if not isinstance(module, TrainModule):
            raise TypeError(f"Trainer.{stage}: `model` must be a `TrainModule`, got `{type(module).__qualname__}`")
        self._connect()
        s = self._strategy
        self.module = module
        module._trainer = self
        # as Lightning: the module's callbacks first, then the data's prepare_data and setup
        self.hooks.callbacks = self.callbacks = merge_callbacks(self.callbacks, module.configure_callbacks())
        self._setup_data(stage, datamodule, module)
        self._stage_setup(stage)
        self._configure_model(module)
        s.setup_module(module)
        s.backward_call = self._module_backward
        s.compile_module()  # Trainer(compile=...) or a torch.compile'd model: per block (strategies/compile.py)
        self._ready = True
        if stage == "fit" or not s.evaluates_without_optimizer:
            self._setup_optimizers()

    def _setup_optimizers(self) -> None:
        """``configure_optimizers`` and the strategy's optimizer set-up, once per Trainer: at the
        first set-up, or, as Lightning (which never asks for optimizers outside ``fit``), at the
        first ``fit`` where the strategy can evaluate without them (``evaluates_without_optimizer``)."""
        if self._optim is None:
            self._configure_optimizers(self.module)
            self._strategy.setup_optimizer(self.optimizer)

    _hooked_stage: str | None = None  # the stage whose setup hooks ran: its teardown hooks are due

    def _stage_setup(self, stage: str) -> None:
        """Lightning's ``setup(stage)`` on every stage: the callbacks', then the module's. As
        Lightning, the loggers' experiments are made first (their run directories exist then)."""
        for logger in self.loggers:
            getattr(logger, "experiment", None)
        self.hooks.both("setup", self, self.module, stage)
        self._hooked_stage = stage

    def _stage_teardown(self, stage: str) -> None:
        """``teardown(stage)`` (callbacks', then the module's) for a stage whose setup hooks ran;
        then, as Lightning at the end of every stage, the loggers' ``finalize`` ("failed" when the
        stage raised), so a logger that buffers writes what each of fit/validate/test/predict logged."""
        if self._hooked_stage == stage:
            self._hooked_stage = None
            self.hooks.both("teardown", self, self.module, stage)
        if self.is_global_zero:
            for lg in self.loggers:
                lg.finalize("failed" if sys.exc_info()[0] is not None else "success")

    def _connect(self) -> None:
        self._launcher = job.join_job(self._strategy, self.precision_plugin, self._accelerator_flag, self.devices,
                                      self.num_nodes, seed=self.seed)  # seeds only a seed the user asked for
        if self.deterministic:
            torch.use_deterministic_algorithms(True)

    def _module_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The strategy's autograd call (``backward_call``): the module's ``backward`` hook,
        looked up at each call (a hook set on the instance later is the one called)."""
        self.module.backward(loss, **kwargs)

    def _configure_model(self, module: TrainModule) -> None:
        """``configure_model`` from global rank 0's torch RNG state on every rank, so a model
        built there (ZeRO-3 partitions it as it is built, and no rank holds it whole to
        broadcast) is one model even when the user seeded ranks differently; the rank's own
        stream is restored afterwards. Ranks whose states already agree are left untouched."""
        s = self._strategy
        if not s.distributed:
            s.configure_model(module)
            return
        own = torch.get_rng_state()
        first = s.broadcast(own)
        if torch.equal(first, own):
            s.configure_model(module)
            return
        torch.set_rng_state(first)
        try:
            s.configure_model(module)
        finally:
            torch.set_rng_state(own)

    def _configure_optimizers(self, module: TrainModule) -> None:
        """``configure_optimizers`` read as Lightning reads it (``trainer/optim/optimization.py``); the
        strategy gets one optimizer, or an ``OptimizerSet`` of several (manual optimization)."""
        self._optim = Optimization(self, module)
        self.optimizer, self.lr_scheduler = self._optim.held, self._optim.scheduler
        self.lr_scheduler_interval = self._optim.schedulers[0].interval if self._optim.schedulers else "step"

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Lightning's ``Trainer.init_module()``: build the model inside it and its tensors are made
        where it will run (this rank's device: the CPU, or ``cuda:<LOCAL_RANK>`` with
        ``accelerator="cuda"``), in a "-true" precision's dtype, inside the strategy's
        ``init_context`` (ZeRO-3 partitions as it builds). ``empty_init=True`` builds on the meta
        device where the strategy materializes the module at set-up (its ``meta_init``:
        ``ModelParallelStrategy``, as Lightning's); elsewhere it is accepted and the weights are
        initialised as usual."""
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if self._accelerator_flag == "cuda" \
            else torch.device("cpu")
        if empty_init and getattr(self._strategy, "meta_init", False):
            device = torch.device("meta")
        dtype = self.precision_plugin.param_dtype if self.precision_plugin.name.endswith("-true") else None
        before = torch.get_default_dtype()
        with self._strategy.init_context(), device:
            if dtype is not None:
                torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(before)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers ``configure_optimizers`` returned (Lightning's ``trainer.optimizers``)."""
        return list(self._optim.optimizers) if self._optim is not None else []

    @property
    def lr_scheduler_configs(self) -> list:
        """Each scheduler with its interval, frequency, monitor and name (Lightning's
        ``trainer.lr_scheduler_configs``; ``trainer/optim/optimization.py`` ``SchedulerConfig``). The live
        list, as Lightning's: a callback may swap or add one (StochasticWeightAveraging)."""
        return self._optim.schedulers if self._optim is not None else []

    _optim: Optimization | None = None

    @property
    def optimization(self) -> Optimization | None:
        """The optimizers and schedulers ``configure_optimizers`` gave, and the steps on them
        (``trainer/optim/optimization.py``): what the module and the checkpoint use; None before set-up."""
        return self._optim
