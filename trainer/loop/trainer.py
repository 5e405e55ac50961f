"""The Trainer: owns the loop, and nothing else.

Everything about how the model is wrapped, partitioned and communicated lives in the Strategy;
everything about dtypes and loss scaling lives in the Precision plugin; everything that observes
the run is a Callback or a Logger. The loop below reads top to bottom and calls each of them
through its interface: it never asks which strategy or precision it holds.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Iterable

import torch
from torch.utils.data import DataLoader

from ...callbacks.base import DummyLogger
from ...strategies import Strategy, instrument, progress
from ...strategies.environment import detect
from ..checkpoint import weights_only as checkpoint_weights, protocol as checkpointing
from ..launch import elastic, job, signals
from ..settings import env_args, plugin_checks, run_options
from ..api import hparams
from ..compat.lightning.profilers import profiler_of
from ..compat.lightning.validator import verify_stage
from .compiled import compile_option, take_compiled
from ..data.batch_transfer import transfer_batch
from ..settings.arguments import check_limit, default_callbacks, fast_dev_run_flags, lightning_callbacks, make_loggers
from ..settings.declaration import canonical_accelerator, declared
from ..errors import ConfigError
from .evaluation import TrainerEvaluation, split_datamodule
from .hooks import HookDispatcher, batch_end_outputs, warn_skipped_hooks
from ..launch.launcher import LocalLauncher
from ..data.loaders import TrainerData, len_or_none, with_last
from ..logs.connector import MetricsConnector, TrainerLogging, hook_scope
from ..api.datamodule import DataModule, overrides_hook
from .model_mode import warn_modules_in_eval, zero_grad_before_validation
from ..api.module import TrainModule
from .limits import TrainerLimits, announce_limits, check_resumed_epoch, no_training
from .properties import TrainerProperties
from .setup import TrainerSetup
from .signature import step_call
from .state import LoopState
from .step import NonFiniteLossError, forward_backward, optimizer_step  # noqa: F401 (the error's old path)
from ..utilities import GLOBAL_SEED_ENV
from ..launch.watchdog import ProgressWatchdog, make_watchdog

log = logging.getLogger("zerotrain")


class Trainer(TrainerProperties, TrainerLimits, TrainerData, TrainerEvaluation, TrainerLogging, TrainerSetup):
    @env_args.environment_defaults  # PL_TRAINER_<ARGUMENT> variables, as Lightning
    @declared()  # each argument's type, default and check: TrainerSettings (trainer/settings/declaration.py)
    def __init__(self, *, accelerator, devices, num_nodes, strategy, precision, max_steps, max_epochs,
                 accumulate_grad_batches, gradient_clip_val, val_check_interval, limit_train_batches,
                 limit_val_batches, limit_test_batches, limit_predict_batches, log_every_n_steps, callbacks, logger,
                 enable_checkpointing, enable_progress_bar, default_root_dir, seed, deterministic, max_restarts,
                 collective_timeout_s, on_nonfinite, stall_timeout_s, use_distributed_sampler, fast_dev_run,
                 num_sanity_val_steps, check_val_every_n_epoch, min_epochs, min_steps, max_time, overfit_batches,
                 gradient_clip_algorithm, enable_model_summary, detect_anomaly, inference_mode,
                 reload_dataloaders_every_n_epochs, benchmark, profiler, barebones, plugins, compile) -> None:
        """As Lightning's Trainer, plus zerotrain's own arguments. ``seed``: None (the default, as
        Lightning, which has no such argument) leaves the global RNGs as the user seeded them;
        an int seeds them with it on every rank at set-up. Either way every rank
        starts from the same weights (strategies broadcast global rank 0's, and a model built in
        ``configure_model`` is built from rank 0's RNG state on every rank). The debugging and
        stopping arguments (``fast_dev_run`` ... ``detect_anomaly``) are Lightning's, see
        ``arguments.fast_dev_run_flags`` and ``_done``; ``inference_mode`` ... ``barebones`` too
        (``run_options.py``). None for a feature flag (logger, checkpointing, ...): on, unless
        ``barebones``; ``log_every_n_steps`` None: 50."""
        flags = run_options.feature_flags(
            barebones, enable_checkpointing=enable_checkpointing, logger=logger,
            enable_progress_bar=enable_progress_bar, log_every_n_steps=log_every_n_steps, enable_model_summary=enable_model_summary,
            num_sanity_val_steps=num_sanity_val_steps, fast_dev_run=fast_dev_run, detect_anomaly=detect_anomaly,
            profiler=profiler)
        enable_checkpointing, logger, enable_progress_bar, log_every_n_steps, enable_model_summary, \
            num_sanity_val_steps = (flags[k] for k in ("enable_checkpointing", "logger", "enable_progress_bar",
                                                        "log_every_n_steps", "enable_model_summary",
                                                        "num_sanity_val_steps"))
        accelerator = canonical_accelerator(accelerator)  # Lightning's name "gpu"
        devices = run_options.device_count(devices, accelerator)
        job.check_cuda("Trainer", accelerator, devices)
        job.check_num_nodes("Trainer", num_nodes)
        self._val_check_time = run_options.val_check_seconds(val_check_interval)  # None unless time-based
        limit_train_batches = check_limit("limit_train_batches", limit_train_batches, allow_zero=True)  # 0: no training
        limit_val_batches = check_limit("limit_val_batches", limit_val_batches, allow_zero=True)
        limit_test_batches = check_limit("limit_test_batches", limit_test_batches, allow_zero=True)
        limit_predict_batches = check_limit("limit_predict_batches", limit_predict_batches, allow_zero=True)
        announce_limits(fast_dev_run, limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
                        limit_test_batches=limit_test_batches, limit_predict_batches=limit_predict_batches,
                        val_check_interval=val_check_interval, overfit_batches=overfit_batches)
        self.precision_plugin, self._strategy = job.plugins("Trainer", strategy, precision, devices * num_nodes)
        self._strategy.step_call = step_call  # Lightning's rule: which arguments each step method takes
        self._strategy.compile = compile_option("Trainer", compile) or self._strategy.compile  # strategies/compile.py
        self.accelerator, self.devices, self.num_nodes = accelerator, int(devices), num_nodes
        self.max_steps, self.max_epochs = max_steps, max_epochs
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.val_check_interval = val_check_interval
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.limit_test_batches, self.limit_predict_batches = limit_test_batches, limit_predict_batches
        self.use_distributed_sampler = bool(use_distributed_sampler)
        self.log_every_n_steps = log_every_n_steps
        if isinstance(default_root_dir, (str, os.PathLike)) and default_root_dir:
            default_root_dir = os.path.expanduser(default_root_dir)  # as Lightning: "~/runs"
        self.default_root_dir = os.path.abspath(default_root_dir or os.getcwd())
        self.seed, self.deterministic = seed, deterministic
        self.benchmark = run_options.set_benchmark(benchmark, deterministic)
        self.inference_mode, self.barebones, self.profiler = inference_mode, barebones, profiler_of(profiler)
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self.on_nonfinite, self.stall_timeout_s = on_nonfinite, stall_timeout_s
        self._watchdog: ProgressWatchdog | None = None
        self._signals: signals.SignalCheckpoint | None = None  # during fit (trainer/launch/signals.py)
        self._fits = 0  # fit() calls in this process: keys the watchdog's store entries
        # restarts (trainer/launch/elastic.py): the process-group timeout after the first step
        self.max_restarts = max_restarts
        self.collective_timeout_s = collective_timeout_s if collective_timeout_s is not None else (
            elastic.DEFAULT_RESTART_TIMEOUT_S if elastic.restarts_enabled(max_restarts) else None)
        self.enable_progress_bar = enable_progress_bar
        # Lightning's: None when not given (the clip is then by norm), else the lower-case name
        self.gradient_clip_algorithm = gradient_clip_algorithm.lower() if gradient_clip_algorithm else None
        self._clip_algorithm_given = gradient_clip_algorithm  # None: not set (Lightning's None)
        self.detect_anomaly = bool(detect_anomaly)
        self.min_epochs, self.min_steps = min_epochs, min_steps
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = math.inf if num_sanity_val_steps == -1 else num_sanity_val_steps
        self.sanity_checking = False
        self.overfit_batches = overfit_batches
        self.fast_dev_run = True if fast_dev_run == 1 else fast_dev_run  # Lightning's: 1 is True
        callbacks = plugin_checks.check_callbacks(callbacks)  # TypeError for callbacks=[1], logger='x'
        if fast_dev_run:
            callbacks = fast_dev_run_flags(self, int(fast_dev_run), callbacks)
            logger = DummyLogger() if logger else False  # Lightning's: logs nothing (checkpoints: the callbacks skip)
        if overfit_batches:
            self.limit_train_batches = self.limit_val_batches = overfit_batches
        callbacks = lightning_callbacks(callbacks, max_time, enable_model_summary)
        self.callbacks = default_callbacks(self._strategy, self.default_root_dir, callbacks, enable_checkpointing,
                                           enable_progress_bar)
        self.loggers = make_loggers(self.default_root_dir, logger)
        self.hooks = HookDispatcher(self.callbacks, mark=self._tick)  # it marks the loop's phases
        self.state = LoopState()
        self.should_stop = False  # a callback ends fit at the next step boundary (EarlyStopping, Timer)
        self.module: TrainModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.lr_scheduler_interval = "step"
        self._logging = MetricsConnector(self)  # self.log, the metric dicts, the loggers' rows
        self._launcher: LocalLauncher | None = None
        self._ready = False
        self.datamodule: DataModule | None = None
        self._predicting = False
        self.train_dataloader: DataLoader | None = None
        self.val_dataloader: DataLoader | None = None
        self.num_training_batches: float = math.inf
        self.is_last_batch = False  # Lightning's: the running training batch is the epoch's last

    # ------------------------------------------------------------------ properties
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def current_epoch(self) -> int:
        return self.state.epoch

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def data_seed(self) -> int:
        """The DistributedSampler's seed: ``Trainer(seed)``, else the last ``seed_everything``
        seed (inherited by launched ranks), else 0 - Lightning's rule (PL_GLOBAL_SEED or 0)."""
        if self.seed is not None:
            return self.seed
        return int(os.environ.get(GLOBAL_SEED_ENV, 0))

    @property
    def log_dir(self) -> str:
        for lg in self.loggers:
            if lg.log_dir:
                return lg.log_dir
        return self.default_root_dir

    # ------------------------------------------------------------------ public API
    def fit(self, model: TrainModule, train_dataloaders: Iterable | DataModule | None = None,
            val_dataloaders: Iterable | None = None, datamodule: DataModule | None = None,
            ckpt_path: str | None = None, weights_only: bool | None = None) -> None:
        """Train, as Lightning's ``fit`` (``fit(model, dm)`` too; ``weights_only``: Lightning's, a
        checkpoint is always read weights-only). ``ckpt_path``: a checkpoint
        directory to resume from, ``"latest"``/``"last"`` (the newest checkpoint of the
        ModelCheckpoint directory, if any) or ``"best"`` (``checkpointing.resume_path``). With
        ``max_restarts`` this process supervises the workers and exits with the job's status
        (``trainer/launch/elastic.py``); a restarted worker resumes from ``latest``."""
        module = model = take_compiled(self._strategy, model, "Trainer.fit")  # Lightning's torch.compile(model)
        if self.max_restarts and not self._ready:
            info = detect(self.devices, self.num_nodes)
            if info.source == "single":  # not yet inside a launched job: supervise one
                raise SystemExit(elastic.ElasticLauncher(info, self.max_restarts).run())
        train_dataloaders, datamodule = split_datamodule("fit", train_dataloaders, datamodule,
                                                          val_dataloaders)
        #: set by a callback (EarlyStopping, Timer): fit ends at the next step boundary. Every
        #: rank must set it together (those callbacks decide collectively)
        self.should_stop = False
        self._start("fit", train_dataloaders)
        try:
            verify_stage(self, module, "fit", datamodule, val_dataloaders)  # Lightning's checks and warnings
            self._setup(module, "fit", datamodule)
            self._start_val_data(val_dataloaders)  # requested in the sanity check, after its start hook, as Lightning's
            ckpt_path = self.ckpt_path = checkpointing.resume_path(self, ckpt_path)
            if ckpt_path:
                self._require_train_loader()  # the resume position depends on its batch size (trainer/checkpoint/reshard.py)
                checkpointing.load(self, ckpt_path)
                check_resumed_epoch(self)
                self._logging.logging_step = self.state.global_step  # Lightning restores its own counter
            self._logging.reset_metrics()
            self._fits += 1
            if self._fits == 1:
                warn_skipped_hooks(self._strategy, self.callbacks, module, self.is_global_zero)
            self._watchdog = make_watchdog(self._strategy, self.stall_timeout_s,
                                           key=f"zerotrain/progress/{elastic.restart_count()}/{self._fits}")
            progress.set_sink(self._watchdog.mark if self._watchdog is not None else None)
            self.hooks.both("on_fit_start", self, module)
            hparams.log_hyperparams(self)
            self._signals = signals.SignalCheckpoint(self, self._launcher)
            self._signals.install()
            if self._watchdog is not None:  # after the fit-start hooks (rank-0-only set-up may run there)
                self._watchdog.arm()
            module.zero_grad()  # as Lightning's stages begin
            with torch.autograd.set_detect_anomaly(self.detect_anomaly):
                self._sanity_check()
                self._require_train_loader()  # as Lightning: after the sanity check, before on_train_start
                self._fit_loop()
            self.hooks.both("on_fit_end", self, module)
        except BaseException as exc:
            raise self._interrupted(exc, module, in_fit=True)
        finally:
            if self._signals is not None:
                self._signals.restore()
            if self._watchdog is not None:
                progress.set_sink(None)
                self._watchdog.disarm()
                self._watchdog = None
            self._logging.stop()
            self._teardown()
            self._teardown_data("fit")
        self._finish()
        done, self._signals = self._signals, None
        done.finished()  # a signal after the last step still ends the process

    def save_checkpoint(self, filepath: str, weights_only: bool = False, storage_options: Any = None, *,
                        update_latest: bool = True) -> None:
        """Collective, Lightning's signature: unsharded state to ``*.ckpt`` is one file in Lightning's
        layout, else every rank writes its shard of the checkpoint directory in parallel and rank 0
        publishes it atomically (``trainer/checkpoint/protocol.py``, ``checkpoint_io.py``, ``checkpoint_file.py``)."""
        checkpointing.refuse_save_options(storage_options)
        with instrument.section("checkpoint"):
            if weights_only:  # one file of Lightning's weights-only keys (trainer/checkpoint/weights_only.py)
                checkpoint_weights.save(self, filepath)
            else:
                checkpointing.save(self, filepath, update_latest)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete unsharded fp32 model state on global rank 0, ``{}`` elsewhere."""
        return self._strategy.full_state_dict()

    def _source(self, hook: str, given: Any) -> Any:
        """Where a stage's data comes from, as Lightning's selector: the loaders passed in, else
        the datamodule's hook if it overrides it, else the module's."""
        if given is not None:
            return given
        for owner in (self.datamodule, self.module):  # a hook set to None (Lightning's way): no data
            if overrides_hook(owner, hook):
                return getattr(owner, hook)()
        return None

    # ------------------------------------------------------------------ the loop
    def _fit_loop(self) -> None:
        """Lightning's fit loop: epochs of batches, each batch a micro-batch of an accumulation
        (``_train_micro_batch``), validation where it is due, then the epoch's end (``_end_epoch``)."""
        st, module = self.state, self.module
        if no_training(self):  # Lightning: nothing to train, no training hooks
            return
        loader = self._train_loader  # the loader, or several combined (trainer/data/fit.py)
        n_batches = self._limit(loader, self.limit_train_batches)
        if n_batches == 0:
            raise ConfigError(f"Trainer.fit: the training loader has no batch (len(train_dataloader)="
                              f"{len_or_none(loader)}, limit_train_batches={self.limit_train_batches!r}): an "
                              "epoch without a training step would never end the run")
        self.num_training_batches = n_batches
        val_batch = self._val_check_batch(n_batches)  # the module's mode is the user's, as Lightning
        self._last_val_time = time.monotonic()  # a time-based val_check_interval counts from here
        self._logging.start_training(n_batches)
        if self._validates_this_epoch():  # as Lightning, the validation data is there from the start (progress bars)
            self._fit_val_loaders()
        self.fit_loop.end_saved_epoch()  # resumed from a save at an epoch's end: the next epoch, as Lightning
        warn_modules_in_eval(module)
        # Lightning's order of the passes' iterators (each draws the DataLoader's base seed from the
        # global RNG): the first pass's before on_train_start (its fit_loop.setup_data), a reloaded
        # loader's once before the epoch's hooks (setup_data again), every later pass's after them
        first = None  # made only where this fit's first pass is of this epoch, from its start
        if not (st.batches_in_epoch or st.cut_batches or st.epoch_ended):  # not a pass resumed mid-way or moved on
            job.set_sampler_epoch(loader, st.epoch)
            first = job.epoch_iterator(loader, resuming=False)
        self.hooks.both("on_train_start", self, module)
        self.fit_loop.continue_cut_epoch()
        while not self._done():
            if self._reload_due(st.epoch):  # reload_dataloaders_every_n_epochs
                loader = self._reload_loaders(st.epoch)
                self.num_training_batches = n_batches = self._limit(loader, self.limit_train_batches)
                val_batch = self._val_check_batch(n_batches)
                iter(loader)  # Lightning's setup_data makes one, unused: the pass's own comes after the hooks
                first = None
            job.set_sampler_epoch(loader, st.epoch)
            skip = self.fit_loop.start_epoch()  # > 0 only when resuming mid-epoch (trainer/loop/progress.py)
            if skip > 0:  # a resumed pass: before the hooks, its draw undone (job.epoch_iterator)
                batches = job.epoch_iterator(loader, resuming=True)
            self.hooks.both("on_train_epoch_start", self, module)
            if skip == 0:
                batches = job.epoch_iterator(loader, resuming=False) if first is None else first
            first = None
            batch_idx = -1
            for batch_idx, (batch, last) in enumerate(with_last(batches, n_batches)):
                if batch_idx >= n_batches or self._done():
                    break
                if batch_idx < skip:
                    continue
                st.batch_ready, self.is_last_batch = batch_idx + 1, last  # fetched (Lightning's fit_loop.batch_idx)
                last_micro = (batch_idx + 1) % self.accumulate_grad_batches == 0 or batch_idx + 1 == n_batches
                stepped = self._train_micro_batch(batch, batch_idx, last_micro)
                if stepped is None:  # on_train_batch_start returned -1: the epoch ends here, without its validation
                    break
                if self._validation_due(val_batch, batch_idx):  # after every batch, as Lightning
                    if stepped and self._validation_defined():  # not inside an accumulation, as Lightning
                        zero_grad_before_validation(self)
                    self._run_validation(self._fit_val_loaders())
                if stepped:  # ReduceLROnPlateau on steps: after the metrics of this step's validation
                    self._optim.step_schedulers("step", plateau=True, index=batch_idx)
                self._logging.batch_done(stepped)
                if stepped and self._signals is not None:  # a SIGTERM on any rank: every rank saves and exits
                    self.hooks.mark("agreeing on stop signals")  # here (trainer/launch/signals.py); none yet in on_fit_start's tuners
                    self._signals.at_step_boundary()
                self.hooks.mark("fetching the next training batch")
            else:
                if batch_idx == -1 and self.max_epochs in (None, -1):  # an empty epoch, and no epoch limit
                    raise ConfigError(f"Trainer.fit: the training loader ({type(loader).__name__}) yielded no "
                                      f"batch in epoch {st.epoch}: an epoch without a training step would "
                                      "never end the run")
            self._end_epoch()  # also when max_steps cut it: Lightning's on_train_epoch_end runs then (no epoch scheduler)
        self.hooks.both("on_train_end", self, module)

    def _train_micro_batch(self, batch: Any, batch_idx: int, last_micro: bool) -> bool | None:
        """One training batch, nanoGPT's step with Lightning's hooks around it: the forwards and
        backwards (under manual optimization the module's step, which steps itself), then on the
        accumulation's last batch the optimizer step (both halves: ``trainer/loop/step.py``).
        Returns whether it was the accumulation's last batch, or None when the module's
        ``on_train_batch_start`` returned -1 (Lightning: the epoch ends before this batch)."""
        st, module = self.state, self.module
        batch = transfer_batch(self, batch)  # Lightning's batch transfer hooks (trainer/data/batch_transfer.py)
        self._logging.on_batch_start(batch)
        if self.hooks.both("on_train_batch_start", self, module, batch, batch_idx) == -1:
            st.epoch_cut = self.is_last_batch = True  # as Lightning: the epoch ends with this batch; its schedulers step
            self._optim.step_schedulers("step", plateau=False, index=batch_idx)
            self._optim.step_schedulers("epoch", plateau=False, index=st.epoch)
            return None
        manual = self._optim.manual  # the step backwards and steps itself (trainer/optim/optimization.py)
        if manual:
            with hook_scope(self, "training_step"):
                out = self._optim.run_manual_step(batch, batch_idx)
        else:
            out = forward_backward(self, batch, batch_idx, last_micro)
        st.batches_in_epoch += 1
        st.total_batches += 1
        if last_micro and not manual:
            self.hooks.both("on_before_optimizer_step", self, module, self.optimizer)
            optimizer_step(self, batch_idx)
        if self._epoch_complete():  # Lightning 2.6: the epoch's schedulers step here, before its validation
            self._optim.step_schedulers("epoch", plateau=False, index=st.epoch)
        out = batch_end_outputs(out, manual, self.accumulate_grad_batches)  # Lightning's outputs
        self.hooks.both("on_train_batch_end", self, module, out, batch, batch_idx)
        self._logging.on_batch_end()
        self._logging.update_train_step_metrics(accumulating=not last_micro)
        return last_micro

    def _end_epoch(self) -> None:
        """Lightning's order at the end of a training epoch (its validation ran after the last
        batch): ``on_train_epoch_end`` (``current_epoch`` is still the epoch that is ending), then the
        ReduceLROnPlateau schedulers of epochs, and only then the epoch counter moves on. (The
        other per-epoch schedulers stepped after the epoch's last batch, as Lightning 2.6 does.)"""
        st = self.state
        st.epoch_phase = 2  # the epoch's training is over (fit_loop.epoch_progress: processed)
        self._logging.epoch_end_reached()
        self.hooks.both("on_train_epoch_end", self, self.module)
        self._logging.on_epoch_end()
        if self._epoch_complete():  # ReduceLROnPlateau on epochs: after the epoch's metrics
            self._optim.step_schedulers("epoch", plateau=True, index=st.epoch)
        self._logging.update_train_epoch_metrics()
        st.cut_batches = st.batches_in_epoch if self._max_steps_reached() and not self._epoch_complete() else 0
        st.epoch += 1
        st.batches_in_epoch = st.epoch_phase = 0

    def _epoch_complete(self) -> bool:
        """Every batch of this epoch's ``num_training_batches`` was trained (Lightning's 'ready
        batches reached', or ``on_train_batch_start`` returned -1): not one cut short by ``max_steps`` or a stop."""
        return self.state.batches_in_epoch >= self.num_training_batches or self.state.epoch_cut

    def _tick(self, phase: str) -> None:
        """The dispatcher's phase marker (``HookDispatcher.mark``)."""
        instrument.phase(phase)  # the ResourceMonitor's step-time breakdown (no-op without one)
        if self._watchdog is not None:
            self._watchdog.tick(phase, self.state.global_step)

    def _teardown(self) -> None:
        self._strategy.teardown()
        self._stage_teardown("fit")
