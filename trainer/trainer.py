"""The Trainer: owns the loop, and nothing else.

Everything about how the model is wrapped, partitioned and communicated lives in the Strategy;
everything about dtypes and loss scaling lives in the Precision plugin; everything that observes
the run is a Callback or a Logger. The loop below reads top to bottom and calls each of them
through its interface: it never asks which strategy or precision it holds.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
from typing import Any, Iterable, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ..callbacks.base import Callback, Logger
from ..strategies import Strategy, precision_from_name, progress, strategy_from_name
from ..strategies.environment import detect, pick_device, set_cpu_threads
from . import checkpointing, elastic
from .errors import ConfigError
from .hooks import HookDispatcher
from .launcher import LocalLauncher
from .module import TrainModule
from .state import LoopState
from .watchdog import ProgressWatchdog, make_watchdog

log = logging.getLogger("zerotrain")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


#: seconds a rank may make no progress while another waits for it (trainer/watchdog.py)
DEFAULT_STALL_TIMEOUT_S = 20.0
#: what a non-finite training loss does under fp32/bf16 (16-mixed: the loss scaler skips the step)
NONFINITE_POLICIES = ("raise", "skip", "warn")


class NonFiniteLossError(FloatingPointError):
    """The training loss is inf or nan (``Trainer(on_nonfinite="raise")``, the default)."""


def _check_limit(name: str, value: Any, allow_zero: bool) -> None:
    """``limit_*_batches``: None, a count (int >= 0) or a fraction of the loader (float in [0, 1])."""
    if value is None:
        return
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, float) and 0.0 <= value <= 1.0)
    if not ok:
        raise ConfigError(f"Trainer: {name}={value!r}; valid: None, an int >= 0 (batches) or a float "
                          "in [0.0, 1.0] (fraction of the loader)")
    if not allow_zero and value == 0:
        raise ConfigError(f"Trainer: {name}={value!r} leaves no batch to train on; valid: an int >= 1 "
                          "or a float in (0.0, 1.0]")


def _positive_int(name: str, value: Any, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"Trainer: {name}={value!r} must be an integer >= {minimum}")


class Trainer:
    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int = "32",
        max_steps: int = -1,
        max_epochs: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        val_check_interval: int | float | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        log_every_n_steps: int = 10,
        callbacks: Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] | None = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool = True,
        default_root_dir: str | None = None,
        seed: int = 0,
        deterministic: bool = False,
        max_restarts: int = 0,
        collective_timeout_s: float | None = None,
        on_nonfinite: str = "raise",
        stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        accelerator = "cuda" if accelerator == "gpu" else accelerator  # Lightning's name for it
        if accelerator not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"Trainer: accelerator={accelerator!r}; valid choices: cpu, cuda (or gpu), auto")
        if devices == "auto":
            devices = torch.cuda.device_count() if accelerator != "cpu" and torch.cuda.is_available() else 1
        _positive_int("devices", devices)
        _positive_int("num_nodes", num_nodes)
        _positive_int("accumulate_grad_batches", accumulate_grad_batches)
        _positive_int("log_every_n_steps", log_every_n_steps)
        _positive_int("max_epochs", max_epochs, allow_none=True)
        _positive_int("max_restarts", max_restarts, minimum=0)
        if collective_timeout_s is not None and not collective_timeout_s > 0:
            raise ConfigError(f"Trainer: collective_timeout_s={collective_timeout_s!r} must be > 0 or None")
        if not isinstance(max_steps, int) or max_steps < -1 or max_steps == 0:
            raise ConfigError(f"Trainer: max_steps={max_steps!r} must be -1 (no limit) or a positive integer")
        if gradient_clip_val is not None and gradient_clip_val <= 0:
            raise ConfigError(f"Trainer: gradient_clip_val={gradient_clip_val!r} must be > 0 or None")
        if isinstance(val_check_interval, float) and not 0 < val_check_interval <= 1:
            raise ConfigError(f"Trainer: val_check_interval={val_check_interval!r} as a float is a "
                              "fraction of an epoch in (0, 1]; give an int for a number of steps")
        if isinstance(val_check_interval, int) and not isinstance(val_check_interval, bool):
            _positive_int("val_check_interval", val_check_interval)
        _check_limit("limit_train_batches", limit_train_batches, allow_zero=False)
        _check_limit("limit_val_batches", limit_val_batches, allow_zero=True)
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"Trainer: on_nonfinite={on_nonfinite!r}; valid choices: "
                              f"{', '.join(NONFINITE_POLICIES)}")
        if stall_timeout_s is not None and (isinstance(stall_timeout_s, bool) or not stall_timeout_s > 0):
            raise ConfigError(f"Trainer: stall_timeout_s={stall_timeout_s!r} must be > 0 (seconds), or None "
                              "to disable the progress watchdog")
        if strategy == "auto":
            strategy = "ddp" if devices * num_nodes > 1 else "single"
        try:
            self.precision_plugin = precision_from_name(precision)
            self._strategy = strategy_from_name(strategy)
        except ValueError as exc:
            raise ConfigError(f"Trainer: {exc}") from None
        self.accelerator, self.devices, self.num_nodes = accelerator, int(devices), num_nodes
        self.max_steps, self.max_epochs = max_steps, max_epochs
        if max_steps == -1 and max_epochs is None:
            self.max_epochs = 1000  # Lightning's default bound
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.val_check_interval = val_check_interval
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = os.path.abspath(default_root_dir or os.getcwd())
        self.seed, self.deterministic = seed, deterministic
        self.on_nonfinite, self.stall_timeout_s = on_nonfinite, stall_timeout_s
        self._watchdog: ProgressWatchdog | None = None
        self._fits = 0  # fit() calls in this process: keys the watchdog's store entries
        # restarts (trainer/elastic.py): the process-group timeout after the first step
        self.max_restarts = max_restarts
        self.collective_timeout_s = collective_timeout_s if collective_timeout_s is not None else (
            elastic.DEFAULT_RESTART_TIMEOUT_S if elastic.restarts_enabled(max_restarts) else None)
        self.enable_progress_bar = enable_progress_bar
        self.callbacks = self._default_callbacks(list(callbacks or []), enable_checkpointing, enable_progress_bar)
        self.loggers = self._make_loggers(logger)
        self.hooks = HookDispatcher(self.callbacks)
        self.state = LoopState()
        self.module: TrainModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.lr_scheduler_interval = "step"
        self.callback_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._step_metrics: dict[str, torch.Tensor] = {}
        self._val_sums: dict[str, list] | None = None
        self._launcher: LocalLauncher | None = None
        self._ready = False
        self.train_dataloader: DataLoader | None = None
        self.val_dataloader: DataLoader | None = None
        self.num_training_batches: float = math.inf

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
    def log_dir(self) -> str:
        for lg in self.loggers:
            if lg.log_dir:
                return lg.log_dir
        return self.default_root_dir

    # ------------------------------------------------------------------ public API
    def fit(self, module: TrainModule, train_dataloaders: Iterable | None = None,
            val_dataloaders: Iterable | None = None, ckpt_path: str | None = None) -> None:
        """Train. ``ckpt_path``: a checkpoint directory to resume from, or ``"latest"`` (the newest
        checkpoint of the ModelCheckpoint directory, if any). With ``max_restarts`` this process
        supervises the workers and exits with the job's status (``trainer/elastic.py``); a
        restarted worker resumes from ``latest``."""
        if self.max_restarts and not self._ready:
            info = detect(self.devices, self.num_nodes)
            if info.source == "single":  # not yet inside a launched job: supervise one
                raise SystemExit(elastic.ElasticLauncher(info, self.max_restarts).run())
        try:
            self._setup(module)
            self.train_dataloader = self._prepare_loader(train_dataloaders or module.train_dataloader(), train=True)
            if self.train_dataloader is None:
                raise ConfigError("Trainer.fit: no training data (pass train_dataloaders or implement "
                                  "train_dataloader())")
            val = val_dataloaders if val_dataloaders is not None else module.val_dataloader()
            self.val_dataloader = self._prepare_loader(val, train=False)
            ckpt_path = checkpointing.resume_path(self, ckpt_path)
            if ckpt_path:
                checkpointing.load(self, ckpt_path)
            self._fits += 1
            if self._fits == 1:
                self._warn_skipped_hooks()
            self._watchdog = make_watchdog(self._strategy, self.stall_timeout_s,
                                           key=f"zerotrain/progress/{elastic.restart_count()}/{self._fits}")
            progress.set_sink(self._watchdog.mark if self._watchdog is not None else None)
            self.hooks("on_fit_start", self, module)
            self._fit_loop()
            self.hooks("on_fit_end", self, module)
        except BaseException as exc:
            self.hooks("on_exception", self, module, exc)
            if self._launcher is not None:  # rank 0 failed: the ranks it started cannot finish
                self._launcher.kill()
            raise
        finally:
            if self._watchdog is not None:
                progress.set_sink(None)
                self._watchdog.disarm()
                self._watchdog = None
            self._teardown()

    def validate(self, module: TrainModule, dataloaders: Iterable | None = None) -> list[dict[str, float]]:
        self._setup(module)
        loader = self._prepare_loader(dataloaders if dataloaders is not None else module.val_dataloader(),
                                      train=False)
        if loader is None:
            raise ConfigError("Trainer.validate: no validation data")
        return [self._run_validation(loader)]

    def save_checkpoint(self, path: str, update_latest: bool = True) -> None:
        """Collective: every rank writes its shard of the checkpoint directory ``path`` in parallel;
        rank 0 then publishes it atomically and points ``latest`` (beside it) at it
        (``trainer/checkpointing.py``; ``trainer/checkpoint_io.py`` describes the format)."""
        checkpointing.save(self, path, update_latest)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete unsharded fp32 model state on global rank 0, ``{}`` elsewhere."""
        return self._strategy.full_state_dict()

    # ------------------------------------------------------------------ set-up
    def _setup(self, module: TrainModule) -> None:
        if self._ready:
            return
        if not isinstance(module, TrainModule):
            raise ConfigError(f"Trainer.fit: expected a TrainModule, got {type(module).__name__}")
        info = detect(self.devices, self.num_nodes)
        if info.must_launch:
            self._launcher = LocalLauncher(info)
            info = self._launcher.launch()
        set_cpu_threads(info)
        device = pick_device(self.accelerator, info.local_rank)
        s = self._strategy
        s.connect(info, device, self.precision_plugin)
        elastic.join_attempt_group(info, device, s.process_group_timeout_s)  # under torchelastic
        s.setup_environment()
        seed_everything(self.seed)
        if self.deterministic:
            torch.use_deterministic_algorithms(True)
        if not s.is_global_zero:
            logging.getLogger("zerotrain").setLevel(logging.WARNING)
        self.module = module
        module._trainer = self
        self.hooks("setup", self, module)
        s.configure_model(module)
        s.setup_module(module)
        self._configure_optimizers(module)
        s.setup_optimizer(self.optimizer)
        self._ready = True

    def _configure_optimizers(self, module: TrainModule) -> None:
        cfg = module.configure_optimizers()
        sched, interval = None, "step"
        if isinstance(cfg, dict):
            opt = cfg.get("optimizer")
            sched_cfg = cfg.get("lr_scheduler")
            if isinstance(sched_cfg, dict):
                sched, interval = sched_cfg.get("scheduler"), sched_cfg.get("interval", "step")
            else:
                sched = sched_cfg
        elif isinstance(cfg, (tuple, list)):
            opt, sched = (cfg[0], cfg[1] if len(cfg) > 1 else None)
            if isinstance(opt, (list, tuple)):
                opt, sched = opt[0], (sched[0] if isinstance(sched, (list, tuple)) and sched else sched)
        else:
            opt = cfg
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"configure_optimizers() must return an optimizer, (optimizer, scheduler) "
                              f"or a dict with 'optimizer'; got {type(cfg).__name__}")
        if interval not in ("step", "epoch"):
            raise ConfigError(f"lr_scheduler interval={interval!r}; valid choices: step, epoch")
        self.optimizer, self.lr_scheduler, self.lr_scheduler_interval = opt, sched, interval

    def _prepare_loader(self, loader: Any, train: bool) -> Any:
        """Put a DistributedSampler under map-style data (keeping the loader's shuffle), so each
        data-parallel rank sees its share, and the order is a pure function of (seed, epoch)."""
        if loader is None or not isinstance(loader, DataLoader):
            return loader
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)) or not hasattr(loader.dataset, "__len__"):
            return loader  # the user's own sampler or an iterable dataset: keep it
        s = self._strategy
        sampler = DistributedSampler(loader.dataset, num_replicas=s.data_parallel_world_size,
                                     rank=s.data_parallel_rank, shuffle=isinstance(loader.sampler, RandomSampler),
                                     seed=self.seed, drop_last=False)
        kwargs = dict(batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      persistent_workers=loader.persistent_workers,
                      # its own generator: starting an epoch must not draw from the global RNG,
                      # or a resumed run's dropout would drift from the uninterrupted one
                      generator=torch.Generator().manual_seed(self.seed))
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        return DataLoader(loader.dataset, **kwargs)

    # ------------------------------------------------------------------ the loop
    def _fit_loop(self) -> None:
        st, module = self.state, self.module
        loader = self.train_dataloader
        n_batches = self._limit(loader, self.limit_train_batches)
        if n_batches == 0:
            raise ConfigError(f"Trainer.fit: the training loader has no batch (len(train_dataloader)="
                              f"{_len_or_none(loader)}, limit_train_batches={self.limit_train_batches!r}): an "
                              "epoch without a training step would never end the run")
        self.num_training_batches = n_batches
        val_every = self._val_every_steps(n_batches)
        module.train()
        while not self._done():
            if hasattr(getattr(loader, "sampler", None), "set_epoch"):
                loader.sampler.set_epoch(st.epoch)
            self._tick("on_train_epoch_start")
            self.hooks("on_train_epoch_start", self, module)
            skip = st.batches_in_epoch  # > 0 only when resuming mid-epoch
            batch_idx = -1
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= n_batches or self._done():
                    break
                if batch_idx < skip:
                    continue
                last_micro = (batch_idx + 1) % self.accumulate_grad_batches == 0 or batch_idx + 1 == n_batches
                stepped = self._train_micro_batch(batch, batch_idx, last_micro)
                if stepped and val_every and self.val_dataloader is not None and st.global_step % val_every == 0:
                    self._run_validation(self.val_dataloader)
                self._tick("fetching the next training batch")
            else:
                if batch_idx == -1:  # a loader without a length that yielded nothing
                    raise ConfigError(f"Trainer.fit: the training loader ({type(loader).__name__}) yielded no "
                                      f"batch in epoch {st.epoch}: an epoch without a training step would "
                                      "never end the run")
                batch_idx = None
            if self._done() and batch_idx is not None and batch_idx < n_batches:
                break  # stopped mid-epoch by max_steps: the epoch is not over
            st.epoch += 1
            st.batches_in_epoch = 0
            if self.lr_scheduler is not None and self.lr_scheduler_interval == "epoch":
                self.lr_scheduler.step()
            self._tick("on_train_epoch_end")
            self.hooks("on_train_epoch_end", self, module)
            if not val_every and self.val_dataloader is not None:
                self._run_validation(self.val_dataloader)
        if self.val_dataloader is not None and self._last_val_step != st.global_step:
            self._run_validation(self.val_dataloader)

    _last_val_step = -1

    def _train_micro_batch(self, batch: Any, batch_idx: int, last_micro: bool) -> bool:
        """One training batch: ``Strategy.run_schedule`` runs its forwards and backwards and calls
        back the hooks it can honour (``_BatchHooks``): every strategy the loss check, the ordinary
        step also ``on_before_backward``/``on_after_backward``; a strategy running its own schedule
        (the pipeline) skips those two (its ``skipped_hooks``, warned about at fit start). Then the
        loss is logged as ``train_loss`` unless the step logged something, and on the last batch of
        an accumulation the optimizer steps."""
        st, s, module = self.state, self._strategy, self.module
        batch = _to_device(batch, s.device)
        self._tick("on_train_batch_start")
        self.hooks("on_train_batch_start", self, module, batch, batch_idx)
        batch_hooks = _BatchHooks(self, batch_idx)
        with (s.no_sync() if not last_micro else contextlib.nullcontext()):
            self._tick("training_step")
            self._train_logged = False
            out = s.run_schedule(batch, batch_idx, batch_hooks)
        loss = batch_hooks.loss
        if loss is None:
            raise RuntimeError(f"strategy={s!r}: run_schedule returned without calling hooks.loss_of; "
                               "valid: every run_schedule checks its loss through hooks.loss_of once")
        if not batch_hooks.step_logged:  # the step logged nothing: track its loss (as val_loss in validation)
            self._log("train_loss", loss)
        self.progress_bar_metrics["loss"] = float(loss.detach())
        st.batches_in_epoch += 1
        st.total_batches += 1
        stepped = False
        if last_micro:
            self._tick("on_before_optimizer_step")
            self.hooks("on_before_optimizer_step", self, module, self.optimizer)
            self._tick("optimizer_step")
            # on_nonfinite="skip": a bad loss on any rank skips the step on every rank together
            if self.on_nonfinite == "skip" and s.any_rank(self._nonfinite_in_step):
                s.skip_step()
            else:
                stepped = s.optimizer_step(self.gradient_clip_val)
            self._nonfinite_in_step = False
            elastic.lower_after_first_step(s, self.collective_timeout_s)
            if self._watchdog is not None:
                self._watchdog.arm()
            if stepped and self.lr_scheduler is not None and self.lr_scheduler_interval == "step":
                self.lr_scheduler.step()
            st.skipped_steps += not stepped
            st.global_step += 1
            if st.global_step % self.log_every_n_steps == 0:
                self._emit(self._collect_step_metrics())
        self._tick("on_train_batch_end")
        self.hooks("on_train_batch_end", self, module, out, batch, batch_idx)
        return last_micro

    _nonfinite_in_step = False
    _train_logged = False

    def _warn_skipped_hooks(self) -> None:
        """A strategy that runs its own schedule never calls some hooks (``Strategy.skipped_hooks``):
        say once (global rank 0, first fit) which callbacks override one, so nothing is silently off."""
        skipped = set(self._strategy.skipped_hooks)
        found = [f"{type(cb).__name__}.{hook}" for cb in self.callbacks for hook in sorted(skipped)
                 if getattr(type(cb), hook, None) is not getattr(Callback, hook, None)]
        if found and self.is_global_zero:
            log.warning("strategy=%r: runs its own forward/backward schedule and never calls %s; these "
                        "overrides will not run: %s", self._strategy, ", ".join(sorted(skipped)), ", ".join(found))

    def _tick(self, phase: str) -> None:
        if self._watchdog is not None:
            self._watchdog.tick(phase, self.state.global_step)

    def _check_finite(self, loss: torch.Tensor, batch_idx: int) -> None:
        """``on_nonfinite`` for fp32/bf16 (a 16-mixed loss scaler skips overflowing steps itself)."""
        if self.precision_plugin.skips_nonfinite_steps or bool(torch.isfinite(loss.detach()).all()):
            return
        where = (f"rank {self.global_rank}: the training loss is {float(loss.detach().float().mean())} at step "
                 f"{self.state.global_step} (epoch {self.state.epoch}, batch {batch_idx})")
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(f"{where}. Lower the learning rate, clip gradients, check the data, or "
                                     "set Trainer(on_nonfinite='skip' | 'warn')")
        log.warning("%s; %s", where, "the step is skipped on every rank" if self.on_nonfinite == "skip"
                    else "training goes on (on_nonfinite='warn')")
        self._nonfinite_in_step = self.on_nonfinite == "skip"

    def _done(self) -> bool:
        st = self.state
        if self.max_steps != -1 and st.global_step >= self.max_steps:
            return True
        return self.max_epochs is not None and st.epoch >= self.max_epochs

    def _limit(self, loader: Any, limit: int | float | None) -> float:
        try:
            total = len(loader)
        except TypeError:
            total = math.inf
        if limit is None:
            return total
        if isinstance(limit, float) and limit <= 1.0:
            return max(1, int(total * limit)) if total != math.inf else math.inf
        return min(total, int(limit))

    def _val_every_steps(self, n_batches: float) -> int | None:
        v = self.val_check_interval
        if v is None or (isinstance(v, float) and v == 1.0):
            return None
        if isinstance(v, float):
            if n_batches == math.inf:
                raise ConfigError("val_check_interval as a fraction needs a loader with a length")
            return max(1, int(n_batches * v / self.accumulate_grad_batches))
        return int(v)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _run_validation(self, loader: Any) -> dict[str, float]:
        s, module = self._strategy, self.module
        limit = self._limit(loader, self.limit_val_batches)
        was_training = module.training
        module.eval()
        self._val_sums = {}
        self.hooks("on_validation_epoch_start", self, module)
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= limit:
                break
            self._val_logged = False
            self._tick("validation_step")
            out = s.validation_step(_to_device(batch, s.device), batch_idx)
            loss = out["loss"] if isinstance(out, dict) else out
            if torch.is_tensor(loss) and not self._val_logged:  # nothing logged: track the loss
                self._log("val_loss", loss)
        sums, self._val_sums = self._val_sums, None
        names = sorted(sums)
        means = torch.tensor([sums[n][0] / max(sums[n][1], 1) for n in names], dtype=torch.float64)
        means = s.reduce(means, op="mean") if names else means  # averaged over ranks
        metrics = {n: float(v) for n, v in zip(names, means.tolist())}
        self.callback_metrics.update(metrics)
        self.progress_bar_metrics.update(metrics)
        self._emit(metrics)
        self._last_val_step = self.state.global_step
        self._tick("on_validation_epoch_end")
        self.hooks("on_validation_epoch_end", self, module)
        if was_training:
            module.train()
        return metrics

    # ------------------------------------------------------------------ logging
    def _log(self, name: str, value: Any, prog_bar: bool = False, sync_dist: bool = False) -> None:
        v = value.detach().float().mean() if torch.is_tensor(value) else torch.tensor(float(value))
        if self._val_sums is not None:
            self._val_logged = True
            acc = self._val_sums.setdefault(name, [0.0, 0])
            acc[0] += float(v)
            acc[1] += 1
            return
        self._train_logged = True
        if sync_dist:
            v = self._strategy.reduce(v, op="mean")
        self._step_metrics[name] = v
        self.callback_metrics[name] = float(v)
        if prog_bar:
            self.progress_bar_metrics[name] = float(v)

    def _collect_step_metrics(self) -> dict[str, float]:
        metrics = {k: float(v) for k, v in self._step_metrics.items()}
        if self.lr_scheduler is not None or self.optimizer is not None:
            metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["epoch"] = float(self.state.epoch)
        return metrics

    def _emit(self, metrics: dict[str, float]) -> None:
        if self.is_global_zero and metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.state.global_step)

    # ------------------------------------------------------------------ construction helpers
    def _default_callbacks(self, callbacks: list, checkpointing: bool, progress: bool) -> list:
        from ..callbacks.checkpoint import ModelCheckpoint
        from ..callbacks.progress import ProgressBar

        if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            callbacks.append(ModelCheckpoint(dirpath=os.path.join(self.default_root_dir, "checkpoints"),
                                             save_last=True))
        if progress and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(ProgressBar())
        return callbacks

    def _make_loggers(self, logger: Any) -> list[Logger]:
        if logger is False or logger is None:
            return []
        if logger is True:
            from ..callbacks.tensorboard import TensorBoardLogger
            return [TensorBoardLogger(os.path.join(self.default_root_dir, "zerotrain_logs"))]
        return list(logger) if isinstance(logger, (list, tuple)) else [logger]

    def _teardown(self) -> None:
        self._strategy.teardown()
        if self.module is not None:
            self.hooks("teardown", self, self.module)
        if self.is_global_zero:
            for lg in self.loggers:
                lg.finalize()


class _BatchHooks:
    """The Trainer's side of one ``Strategy.run_schedule`` call (``strategies.base.BatchHooks``):
    checks the loss, keeps it for the progress bar and ``train_loss``, and fires the backward
    hooks when the strategy calls them."""

    def __init__(self, trainer: Trainer, batch_idx: int) -> None:
        self.trainer, self.batch_idx = trainer, batch_idx
        self.accumulation = trainer.accumulate_grad_batches
        self.loss: torch.Tensor | None = None
        self.step_logged = False

    def loss_of(self, out: Any) -> torch.Tensor:
        loss = out["loss"] if isinstance(out, dict) else out
        if not torch.is_tensor(loss):
            raise ConfigError(f"training_step must return a loss tensor or a dict with 'loss'; "
                              f"got {type(out).__name__}")
        self.trainer._check_finite(loss, self.batch_idx)
        self.loss = loss
        self.step_logged = self.trainer._train_logged  # by the step itself, not by the hooks after it
        return loss

    def before_backward(self, loss: torch.Tensor) -> None:
        t = self.trainer
        t._tick("on_before_backward")
        t.hooks("on_before_backward", t, t.module, loss)
        t._tick("backward")

    def after_backward(self) -> None:
        t = self.trainer
        t._tick("on_after_backward")
        t.hooks("on_after_backward", t, t.module)


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _len_or_none(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
