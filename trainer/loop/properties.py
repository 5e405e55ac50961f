"""Lightning's Trainer attributes that Lightning code reads (and a few it sets): the checkpoint and
early-stopping callbacks, ``estimated_stepping_batches`` (what OneCycleLR schedules are built
from, available inside ``configure_optimizers``), ``interrupted``, ``received_sigterm``,
``model``/``lightning_module``, ``device_ids``, the stage flags, a settable ``logger``, and the
training data loaded on demand and reloaded every ``reload_dataloaders_every_n_epochs``. A mixin
of :class:`~.trainer.Trainer`."""
from __future__ import annotations

import logging
import math
import signal
from typing import Any

from ..data.fit import FitLoaders, fit_loaders
from ..launch.launcher import is_peer_loss
from .progress import TrainerLoops
from ..settings.run_options import default_max_epochs
from .state import RunningStage, TrainerFn, TrainerStatus

log = logging.getLogger("zerotrain")
_UNSET = object()  # no fit is loading its training data


class TrainerProperties(TrainerLoops):
    """Lightning's read-only view of the Trainer, and the training data's loading (and, from
    ``TrainerLoops``, the loop objects' counters: ``fit_loop``, ``test_loop`` ...)."""

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``trainer.print``: the built-in ``print`` on each node's local rank 0 only."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ callbacks
    def _callbacks_of(self, kind: type) -> list:
        return [cb for cb in self.callbacks if isinstance(cb, kind)]

    @property
    def checkpoint_callbacks(self) -> list:
        from ...callbacks.checkpoint import ModelCheckpoint
        return self._callbacks_of(ModelCheckpoint)

    @property
    def checkpoint_callback(self) -> Any:
        """The first ModelCheckpoint, or None."""
        return next(iter(self.checkpoint_callbacks), None)

    @property
    def _checkpoint_connector(self) -> Any:
        """The few entry points of Lightning's checkpoint connector (``trainer/compat/lightning/checkpoint_connector.py``)."""
        from ..compat.lightning.checkpoint_connector import CheckpointConnector
        return CheckpointConnector(self)

    @property
    def _data_connector(self) -> "DataConnector":
        """The few entry points of Lightning's data connector (``DataConnector`` below)."""
        return DataConnector(self)

    def _attach_data(self, model: Any, loaders: tuple | None = None, datamodule: Any = None) -> None:
        """``model`` and its data attached as ``fit`` attaches them, without running a stage: the
        (training, validation) loaders given (None: the datamodule's or the module's hook, asked
        when needed, e.g. by ``estimated_stepping_batches`` or ``fit_loop.setup_data()``)."""
        self.module, model.trainer = model, self
        if datamodule is not None:
            self.datamodule, datamodule.trainer = datamodule, self
        if loaders is None and self._train_source is not _UNSET:
            return  # the loaders attached before stay
        train, val = loaders or (None, None)
        self.train_dataloader, self._train_source, self._fit_loaders_given = None, train, train is not None
        self._start_val_data(val)

    @property
    def accelerator(self) -> Any:
        """Lightning's: the Accelerator this Trainer runs on (``CPUAccelerator`` or
        ``CUDAAccelerator``, "auto" resolved); it compares equal to its name ("cpu", "cuda")."""
        from ..compat.lightning.accelerators import accelerator_for
        return accelerator_for(self._accelerator_flag)

    @accelerator.setter
    def accelerator(self, flag: str) -> None:
        self._accelerator_flag = flag  # "cpu", "cuda" or "auto", as checked by the Trainer

    @property
    def _accelerator_connector(self) -> Any:
        """What Lightning code reads of its accelerator connector (``trainer/compat/lightning/accelerator_connector.py``)."""
        from ..compat.lightning.accelerator_connector import AcceleratorConnectorView
        return AcceleratorConnectorView(self)

    @property
    def progress_bar_callback(self) -> Any:
        """The progress bar (Lightning's ``ProgressBar``) among the callbacks, or None."""
        from ...callbacks.progress import ProgressBar
        return next(iter(self._callbacks_of(ProgressBar)), None)

    @property
    def early_stopping_callbacks(self) -> list:
        from ...callbacks.early_stopping import EarlyStopping
        return self._callbacks_of(EarlyStopping)

    @property
    def early_stopping_callback(self) -> Any:
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def node_rank(self) -> int:
        """Lightning's ``trainer.node_rank``: this process's node (0 on one machine, and before a
        stage has joined the job)."""
        return self._strategy.info.node_rank

    @property
    def _detect_anomaly(self) -> bool:
        """Lightning's name for ``detect_anomaly`` (its barebones tests read it)."""
        return self.detect_anomaly

    # ------------------------------------------------------------------ loggers
    @property
    def logger(self) -> Any:
        """The first logger, or None (Lightning's ``trainer.logger``); setting it replaces every
        logger (None: no logging)."""
        return self.loggers[0] if self.loggers else None

    @logger.setter
    def logger(self, logger: Any) -> None:
        self.loggers = [] if logger is None else [logger]

    # ------------------------------------------------------------------ the model, the run
    @property
    def lightning_module(self) -> Any:
        return self.module

    @property
    def model(self) -> Any:
        """The module being trained (Lightning's ``trainer.model`` is the strategy's wrapper of it
        under DDP; zerotrain's wrappers route the step methods and are no user-facing model)."""
        return self.module

    @property
    def device_ids(self) -> list[int]:
        """The device indices this node uses (0 .. devices-1 on CPU, as Lightning)."""
        return list(range(self.devices))

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    @property
    def interrupted(self) -> bool:
        """``fit`` ended by a KeyboardInterrupt (or another exception): Lightning's flag."""
        return self.state.status == TrainerStatus.INTERRUPTED

    @property
    def received_sigterm(self) -> bool:
        return self._signals is not None and self._signals.received == signal.SIGTERM

    @property
    def fitting(self) -> bool:
        return self.state.fn == TrainerFn.FITTING

    @property
    def training(self) -> bool:
        return self.state.stage == RunningStage.TRAINING

    @property
    def validating(self) -> bool:
        return self.state.stage == RunningStage.VALIDATING

    @property
    def testing(self) -> bool:
        return self.state.stage == RunningStage.TESTING

    @property
    def predicting(self) -> bool:
        return self.state.stage == RunningStage.PREDICTING

    ckpt_path: str | None = None  # the checkpoint the running stage loaded (Lightning's)

    # ------------------------------------------------------------------ a stage's start and end
    def _start(self, fn: str, train_source: Any = _UNSET) -> None:
        """A ``fit``/``validate``/``test``/``predict`` call begins: Lightning's ``state``; ``fit``
        loads its training data on demand (``_load_train_loader``)."""
        self.state.fn, self.state.status = TrainerFn(fn), TrainerStatus.RUNNING
        self.state.stage = RunningStage.TRAINING if fn == "fit" else RunningStage(fn)
        self.profiler.setup(stage=fn, local_rank=None, log_dir=None)  # Lightning's: describe() at the stage's end
        if self._launcher is not None:  # the ranks this process started are watched while a stage runs
            self._launcher.watch()
        if fn == "fit":
            self.max_epochs = default_max_epochs(self.max_epochs, self.max_steps, self.callbacks)  # at fit, as Lightning
            self.train_dataloader, self._train_source, self._loaded_epoch = None, train_source, 0
            self._fit_loaders_given = train_source is not None

    def _finish(self) -> None:
        self.state.status, self.state.stage = TrainerStatus.FINISHED, None
        if self._launcher is not None:
            self._launcher.unwatch()
        self.profiler.describe()

    def _interrupted(self, exc: BaseException, module: Any, in_fit: bool = False) -> BaseException:
        """An exception ends the stage, as Lightning's: ``interrupted`` is set and the callbacks'
        ``on_exception`` run; in ``fit`` the ranks rank 0 started are ended (after a SIGTERM they
        exit by themselves). Returns what to raise: a KeyboardInterrupt is a graceful shutdown that
        exits with status 1 (SystemExit, as Lightning), anything else itself."""
        from ..launch.signals import SIGTERMException

        self.state.status = TrainerStatus.INTERRUPTED
        try:
            self.hooks("on_exception", self, module, exc)
            if getattr(self.datamodule, "on_exception", None) is not None:  # then the datamodule's, as Lightning
                self.datamodule.on_exception(exc)
            self._strategy.on_exception(exc)  # then the strategy's, as Lightning
        finally:  # an on_exception that raises still ends the ranks (they would wait in a collective)
            if in_fit and self._launcher is not None and not isinstance(exc, SIGTERMException):
                self._launcher.kill(in_fit=True, peer_lost=is_peer_loss(exc))
            if self._launcher is not None:
                self._launcher.unwatch()
        if isinstance(exc, KeyboardInterrupt):
            if self.is_global_zero:
                log.info("Detected KeyboardInterrupt, attempting graceful shutdown ...")
            stop = SystemExit(1)
            stop.__cause__ = exc
            return stop
        return exc

    # ------------------------------------------------------------------ training data
    @property
    def estimated_stepping_batches(self) -> float:
        """The optimizer steps ``fit`` will take at most (Lightning's formula): the training
        loader's batches (after ``limit_train_batches``) per accumulation, times ``max_epochs``,
        capped by ``max_steps``; ``inf`` for an endless run. Inside ``configure_optimizers`` it
        loads the training data first, as Lightning does."""
        if self.max_epochs in (None, -1):
            return math.inf if self.max_steps == -1 else self.max_steps
        if self.train_dataloader is None and self._train_source is not _UNSET:
            log.info("Loading `train_dataloader` to estimate number of stepping batches.")
            self._load_train_loader()
        total = self.num_training_batches if self.train_dataloader is None else \
            self._limit(self._train_loader, self.limit_train_batches)
        if total == math.inf:
            return math.inf if self.max_steps == -1 else self.max_steps
        steps = math.ceil(total / self.accumulate_grad_batches) * max(self.max_epochs, 1)
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    _train_source: Any = _UNSET  # fit's train_dataloaders argument, until the loader is loaded

    def _load_train_loader(self) -> None:
        """``fit``'s training loader (the one given, the datamodule's or the module's), prepared."""
        given, self._train_source = self._train_source, _UNSET
        self._train_loader = fit_loaders(self._source("train_dataloader", given),
                                         lambda loader: self._overfit(self._prepare_loader(loader, "fit")))

    _train_loader: Any = None  # what the fit loop iterates: the loader, or several as a FitLoaders

    @property
    def train_dataloader(self) -> Any:
        """Lightning's: ``fit``'s training loader, or the list/dict of them (``trainer/data/fit.py``)."""
        loader = self._train_loader
        return loader.iterables if isinstance(loader, FitLoaders) else loader

    @train_dataloader.setter
    def train_dataloader(self, loader: Any) -> None:
        self._train_loader = loader

    def _reload_due(self, epoch: int) -> bool:
        """``reload_dataloaders_every_n_epochs``: this epoch requests the loaders again."""
        n = self.reload_dataloaders_every_n_epochs
        return bool(n) and epoch > 0 and epoch - self._loaded_epoch >= n

    _loaded_epoch = 0

    def _reload_loaders(self, epoch: int) -> Any:
        """Request the training loader again (from the datamodule or the module, Lightning's rule:
        loaders passed to ``fit`` are kept as they are); returns it. The validation loaders have
        their own timing (``_fit_val_loaders``)."""
        log.info("epoch %d: reloading the training dataloader (reload_dataloaders_every_n_epochs=%d)", epoch,
                 self.reload_dataloaders_every_n_epochs)
        self._loaded_epoch = epoch
        if not self._fit_loaders_given:
            self._train_source = None
            self._load_train_loader()
        return self._train_loader

    _fit_loaders_given = False



class DataConnector:
    """``trainer._data_connector``: what Lightning's public tests call to give a Trainer its data
    without running a stage (``attach_data``, ``attach_dataloaders``, ``attach_datamodule``,
    ``prepare_data``), each a front on the Trainer's own data code. Not Lightning's connector:
    nothing else of it is here."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def prepare_data(self) -> None:
        """The datamodule's and then the module's ``prepare_data`` where this process runs it:
        local rank 0 of each node (``prepare_data_per_node=True``, the default), else only node
        0's local rank 0. No barrier (the stages' own call waits for it)."""
        from ..api.datamodule import overrides_hook
        from .hooks import datamodule_hook

        t = self.trainer
        for owner in (t.datamodule, t.lightning_module):
            if owner is None or not overrides_hook(owner, "prepare_data"):
                continue
            if t.local_rank == 0 and (getattr(owner, "prepare_data_per_node", True) or t.node_rank == 0):
                if owner is t.datamodule:
                    datamodule_hook(t, owner, "prepare_data")
                else:
                    owner.prepare_data()

    def attach_data(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
                    test_dataloaders: Any = None, predict_dataloaders: Any = None, datamodule: Any = None) -> None:
        self.attach_dataloaders(model, train_dataloaders, val_dataloaders, test_dataloaders, predict_dataloaders)
        self.attach_datamodule(model, datamodule)

    def attach_dataloaders(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
                           test_dataloaders: Any = None, predict_dataloaders: Any = None) -> None:
        """Only ``fit``'s loaders can be attached ahead: ``test``/``predict`` take theirs as arguments."""
        if test_dataloaders is not None or predict_dataloaders is not None:
            raise NotImplementedError("trainer._data_connector: attach test/predict loaders by passing them to "
                                      "trainer.test(...) / trainer.predict(...)")
        self.trainer._attach_data(model, (train_dataloaders, val_dataloaders))

    def attach_datamodule(self, model: Any, datamodule: Any = None) -> None:
        self.trainer._attach_data(model, datamodule=datamodule)
