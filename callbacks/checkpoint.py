"""ModelCheckpoint: Lightning's checkpointing callback, each checkpoint written atomically.
(No ``from __future__ import annotations``: the CLI builds its arguments from this signature's
real types.)"""
import logging
import math
import os
import shutil
import time
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch

from ..trainer.checkpoint.single_file import file_suffix, newest
from ..trainer.errors import CheckpointError, ConfigError
from . import checkpoint_names as names
from .base import Callback

log = logging.getLogger("zerotrain")


class ModelCheckpoint(Callback):
    """Lightning's ModelCheckpoint, with Lightning's defaults and rules.

    By default a checkpoint ``dirpath/epoch={epoch}-step={step}.ckpt`` is saved at the end of every
    training epoch (after validation when validation runs within the epoch or every n-th epoch
    only), and, without ``monitor``, only the newest is kept (``save_top_k=1``; ``-1`` keeps all,
    ``0`` none). With ``monitor``, the ``save_top_k`` best by that metric (``mode`` "min"/"max") are
    kept. ``every_n_train_steps``, ``every_n_epochs`` (0: never) and ``train_time_interval`` (a
    ``timedelta``, checked after each training batch) choose when to save, one of them at most.
    ``save_last=True`` also writes ``last.ckpt`` after each save (``last-v1.ckpt``, ... when that
    name is taken by another run's file); ``"link"`` makes it a relative symbolic link to the newest
    checkpoint. ``dirpath`` defaults to the first logger's ``<save_dir>/<name>/<version>/checkpoints``
    (``default_root_dir/checkpoints`` without a logger); ``~`` is the home folder.

    zerotrain's differences: a checkpoint of sharded state (``zero2``, ``zero3``, pipelines) is a
    folder ``NAME.ckpt`` (one shard file per rank, ``trainer/checkpoint/directory.py``), and a ``latest``
    pointer beside it names the newest; ``save_weights_only`` writes one consolidated
    ``.safetensors`` file of the weights. Every file or folder is written atomically (the previous
    one stays whole until the new one is complete). Saving is a collective: the callback runs on
    every rank.
    """

    #: the Trainer's own (``enable_checkpointing=True`` without one given): its differences are info only
    made_by_trainer = False
    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1

    def __init__(self, dirpath: str | None = None, filename: str | None = None, monitor: str | None = None,
                 verbose: bool = False, save_last: bool | str | None = None, save_top_k: int = 1,
                 save_on_exception: bool = False, save_weights_only: bool = False, mode: str = "min",
                 auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: timedelta | None = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True) -> None:
        if mode not in ("min", "max"):  # Lightning's messages, ConfigError being its MisconfigurationException
            raise ConfigError(f"`mode` can be min, max but got {mode}")
        if save_last not in (True, False, None, "link"):
            raise ConfigError(f"ModelCheckpoint: save_last={save_last!r}; valid choices: True, False, None, 'link'")
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            every_n_train_steps, every_n_epochs = 0, 1  # Lightning's: once per epoch
        every_n_train_steps, every_n_epochs = every_n_train_steps or 0, every_n_epochs or 0
        if save_top_k < -1:
            raise ConfigError(f"Invalid value for save_top_k={save_top_k}. Must be >= -1")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value < 0:
                raise ConfigError(f"Invalid value for {name}={value}. Must be >= 0")
        if (every_n_train_steps >= 1) + (every_n_epochs >= 1) + (train_time_interval is not None) > 1:
            raise ConfigError(f"Combination of parameters every_n_train_steps={every_n_train_steps}, "
                              f"every_n_epochs={every_n_epochs} and train_time_interval={train_time_interval} "
                              "should be mutually exclusive.")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ConfigError(f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. "
                              "No quantity for top_k to track.")
        if dirpath and names.is_local(dirpath):
            dirpath = os.path.realpath(os.path.expanduser(dirpath))  # Lightning's: ~ is the home folder
        self.dirpath, self.filename, self.monitor, self.mode = dirpath, filename, monitor, mode
        self.verbose, self.save_last, self.save_top_k = verbose, save_last, save_top_k
        self.save_on_exception, self.save_weights_only = save_on_exception, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self._every_n_train_steps, self._every_n_epochs = every_n_train_steps, every_n_epochs
        self._train_time_interval = train_time_interval
        self._save_on_train_epoch_end, self._enable_version_counter = save_on_train_epoch_end, enable_version_counter
        self._last_global_step_saved = 0  # nothing to save before a step is taken
        self._last_time_checked: float | None = None
        self._last_checkpoint_saved = ""
        self._defer_save_until_validation = False  # a step/time trigger waits for the monitored metric
        self.current_score: torch.Tensor | None = None
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.best_model_score: torch.Tensor | None = None
        self.best_model_path = ""
        self.last_model_path = ""
        self._noted = False
        self._said_missing = False

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint's ``callbacks``."""
        triggers = {"monitor": self.monitor, "mode": self.mode, "every_n_train_steps": self._every_n_train_steps,
                    "every_n_epochs": self._every_n_epochs, "train_time_interval": self._train_time_interval}
        return f"{type(self).__qualname__}{triggers}"

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    @property
    def every_n_train_steps(self) -> int:
        return self._every_n_train_steps

    @property
    def train_time_interval(self) -> timedelta | None:
        return self._train_time_interval

    @property
    def save_on_train_epoch_end(self) -> bool | None:
        return self._save_on_train_epoch_end

    @property
    def enable_version_counter(self) -> bool:
        return self._enable_version_counter

    @property
    def last_path(self) -> str | None:
        """The checkpoint this callback saved last in this process (``last.ckpt`` included), or None."""
        return self._last_checkpoint_saved or None

    @property
    def latest_path(self) -> str | None:
        """The newest checkpoint in ``dirpath`` (its ``latest`` pointer, else its newest .ckpt file), or None."""
        latest = newest(self.dirpath) if self.dirpath and names.is_local(self.dirpath) else None
        return str(latest) if latest is not None else None

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer, pl_module, stage: str | None = None) -> None:
        self.dirpath = trainer.strategy.broadcast(self.dirpath or names.default_dirpath(trainer))
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0 and os.path.isdir(self.dirpath) \
                and os.listdir(self.dirpath):
            warnings.warn(f"Checkpoint directory {self.dirpath} exists and is not empty.", stacklevel=2)
        if self.save_last == "link" and not names.is_local(self.dirpath):
            raise ValueError("`ModelCheckpoint(save_last='link')` is only supported for local file paths, got "
                             f"`dirpath={self.dirpath}`.")

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_time_checked = time.monotonic()
        if not self._noted and trainer.is_global_zero:
            self._noted = True
            self._note_differences()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """The step and time triggers (a monitored metric not logged yet, or about to be renewed by the
        validation that follows this epoch's last batch: the save waits for that validation's end)."""
        n = self._every_n_train_steps
        skip_step = n < 1 or trainer.global_step % n != 0
        skip_time, now = True, time.monotonic()
        if self._train_time_interval is not None:
            prev = self._last_time_checked
            skip_time = prev is None or now - prev < self._train_time_interval.total_seconds()
            skip_time = trainer.strategy.broadcast(skip_time)  # rank 0's clock decides for all
        if skip_step and skip_time:
            return
        if not skip_time:
            self._last_time_checked = now
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and (self.monitor not in candidates or (
                not self._should_save_on_train_epoch_end(trainer) and getattr(trainer, "is_last_batch", False)
                and self._validates_after_epoch(trainer))):
            self._defer_save_until_validation = True
            return
        if self._should_skip_saving_checkpoint(trainer):
            return
        if not skip_step and not getattr(pl_module, "automatic_optimization", True) and trainer.is_global_zero:
            warnings.warn("Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
                          "pre-optimization state was saved. The checkpoint will contain the model state AFTER "
                          "optimization (this step's optimizer.step() calls).", UserWarning, stacklevel=2)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._epoch_trigger(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        if self._defer_save_until_validation:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self._defer_save_until_validation = False
            return
        self._epoch_trigger(trainer)

    def _epoch_trigger(self, trainer) -> None:
        """The epoch trigger, then ``last`` when this step was saved (with ``"link"``: once any was)."""
        candidates = self._monitor_candidates(trainer)
        n = self._every_n_epochs
        if n >= 1 and (trainer.current_epoch + 1) % n == 0:
            self._save_topk_checkpoint(trainer, candidates)
        if self._last_global_step_saved == trainer.global_step or (
                self.save_last == "link" and self._last_checkpoint_saved):
            self._save_last_checkpoint(trainer, candidates)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """``save_on_exception``: a checkpoint of the state the exception left, when a step was taken
        since the last save (not in the sanity check; not after SIGTERM/SIGUSR1, which saved already).
        Saving is a collective: every rank must be here. A failed save is logged and the original
        exception goes on."""
        from ..trainer.launch.signals import SIGTERMException

        if not self.save_on_exception or isinstance(exception, SIGTERMException) or trainer.fast_dev_run \
                or trainer.sanity_checking or self._last_global_step_saved == trainer.global_step \
                or self.dirpath is None:
            return
        candidates = self._monitor_candidates(trainer)
        path = self.format_checkpoint_name(candidates)
        try:
            self._save_checkpoint(trainer, path)
            self._save_last_checkpoint(trainer, candidates)
        except Exception as exc:  # noqa: BLE001 - the exception that ended fit is the one to raise
            log.error("ModelCheckpoint(save_on_exception=True): saving failed: %r", exc)
            return
        if trainer.is_global_zero:
            log.info("An %s was raised with message: %s, saved checkpoint to %s", type(exception).__name__,
                     exception, path)

    def on_train_end(self, trainer, pl_module) -> None:
        """``save_last``: a ``last`` checkpoint when this callback saved none during fit."""
        if self.save_last and not self._last_checkpoint_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "best_model_score": self.best_model_score,
                "best_model_path": self.best_model_path, "current_score": self.current_score,
                "dirpath": None if self.dirpath is None else str(self.dirpath),
                "best_k_models": dict(self.best_k_models), "kth_best_model_path": self.kth_best_model_path,
                "kth_value": self.kth_value, "last_model_path": self.last_model_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As Lightning's: the whole state when saved with this ``dirpath``, else ``best_model_path`` only."""
        saved_dir = state.get("dirpath", self.dirpath)
        if self.dirpath == saved_dir:
            self.best_model_score = state.get("best_model_score")
            self.kth_best_model_path = state.get("kth_best_model_path", self.kth_best_model_path)
            self.kth_value = state.get("kth_value", self.kth_value)
            self.best_k_models = dict(state.get("best_k_models", self.best_k_models))
            self.last_model_path = state.get("last_model_path", self.last_model_path)
            self.current_score = state.get("current_score", self.current_score)
        else:
            warnings.warn(f"The dirpath has changed from {saved_dir!r} to {self.dirpath!r}, therefore "
                          "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and "
                          "`best_k_models` won't be reloaded. Only `best_model_path` will be reloaded.",
                          stacklevel=2)
        self.best_model_path = state.get("best_model_path", "") or ""

    # ------------------------------------------------------------------ decisions
    def _should_skip_saving_checkpoint(self, trainer) -> bool:
        return bool(trainer.fast_dev_run) or trainer.state.fn != "fit" or trainer.sanity_checking \
            or self._last_global_step_saved == trainer.global_step

    def _should_save_on_train_epoch_end(self, trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        return names.epoch_end_by_default(trainer)

    @staticmethod
    def _validates_after_epoch(trainer) -> bool:
        """A validation runs after this epoch's last training batch."""
        if getattr(trainer, "val_dataloader", None) is None or getattr(trainer, "limit_val_batches", 1) == 0:
            return False
        every = getattr(trainer, "check_val_every_n_epoch", 1)
        return every is None or (trainer.current_epoch + 1) % every == 0

    def check_monitor_top_k(self, trainer, current: torch.Tensor | None = None) -> bool:
        """Whether ``current`` enters the top ``save_top_k`` (decided by all ranks together)."""
        if current is None:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        kth = self.best_k_models[self.kth_best_model_path]
        better = bool(current < kth) if self.mode == "min" else bool(current > kth)
        return not trainer.strategy.any_rank(not better)  # every rank must agree to save

    # ------------------------------------------------------------------ saving
    def _monitor_candidates(self, trainer) -> dict[str, Any]:
        """What ``monitor`` and ``filename`` may name: the logged metrics, with ``epoch`` and ``step``
        as integer tensors (the current counters where not logged)."""
        out = dict(trainer.callback_metrics)
        epoch, step = out.get("epoch"), out.get("step")
        out["epoch"] = epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
        out["step"] = step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
        return out

    def _save_topk_checkpoint(self, trainer, candidates: dict[str, Any]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is None:
            self._save_none_monitor_checkpoint(trainer, candidates)
            return
        if self.monitor not in candidates:
            message = (f"`ModelCheckpoint(monitor={self.monitor!r})` could not find the monitored key in the "
                       f"returned metrics: {list(candidates)}. HINT: Did you call `log({self.monitor!r}, value)` "
                       "in the `LightningModule`?")
            if getattr(getattr(trainer, "state", None), "last_val_step", -1) >= 0:  # a validation ran: it should be there
                raise ConfigError(message)
            if not self._said_missing:
                self._said_missing = True
                warnings.warn(message, stacklevel=2)
        current = candidates.get(self.monitor)
        if self.check_monitor_top_k(trainer, current):
            self._update_best_and_save(current, trainer, candidates)
        elif self.verbose and trainer.is_global_zero:
            log.info("Epoch %d, global step %d: %r was not in top %d", int(candidates["epoch"]),
                     int(candidates["step"]), self.monitor, self.save_top_k)

    def _save_none_monitor_checkpoint(self, trainer, candidates: dict[str, Any]) -> None:
        path = self._unused_name(trainer, candidates, self.best_model_path)
        previous, self.best_model_path = self.best_model_path, path  # before saving: it is in the state
        self._save_checkpoint(trainer, path)
        if self.save_top_k == 1 and previous:
            self._remove_if_unkept(trainer, previous, path)

    def _update_best_and_save(self, current: Any, trainer, candidates: dict[str, Any]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        dropped = None
        if len(self.best_k_models) == k and k > 0:
            dropped = self.kth_best_model_path
            self.best_k_models.pop(dropped)
        current = current.detach().cpu() if isinstance(current, torch.Tensor) else torch.tensor(float(current))
        if torch.isnan(current):  # Lightning's: NaN ranks as the worst
            current = torch.tensor(math.inf if self.mode == "min" else -math.inf)
        path = self._unused_name(trainer, candidates, dropped)
        self.current_score = current
        self.best_k_models[path] = current
        if len(self.best_k_models) == k:
            worst = max if self.mode == "min" else min
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        best = min if self.mode == "min" else max
        self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose and trainer.is_global_zero:
            log.info("Epoch %d, global step %d: %r reached %0.5f (best %0.5f), saving model to %r as top %d",
                     int(candidates["epoch"]), int(candidates["step"]), self.monitor, float(current),
                     float(self.best_model_score), path, k)
        self._save_checkpoint(trainer, path)
        if dropped:
            self._remove_if_unkept(trainer, dropped, path)

    def _save_last_checkpoint(self, trainer, candidates: dict[str, Any]) -> None:
        if not self.save_last:
            return
        path = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)
        if self._enable_version_counter:
            version = self.STARTING_VERSION
            while self.file_exists(path, trainer) and path != self.last_model_path:
                path = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST, ver=version)
                version += 1
        previous, self.last_model_path = self.last_model_path, path  # before saving: it is in the state
        if self.save_last == "link" and self._last_checkpoint_saved and self.save_top_k != 0:
            self._link_checkpoint(trainer, self._last_checkpoint_saved, path)
        else:
            self._save_checkpoint(trainer, path)
        if previous:
            self._remove_if_unkept(trainer, previous, path)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        try:
            if self.save_weights_only:
                self._save_weights(trainer, filepath)
            else:
                with file_suffix(self.FILE_EXTENSION):  # a file whatever the extension, as Lightning's
                    trainer.save_checkpoint(filepath, False)  # positional, as Lightning calls it (mocks see it)
        except CheckpointError as exc:  # name the setting that chose the path
            raise CheckpointError(f"{exc} (ModelCheckpoint dirpath={self.dirpath!r})") from exc
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                getattr(logger, "after_save_checkpoint", lambda _: None)(weakref.proxy(self))

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        """``linkpath`` becomes a relative symbolic link to ``filepath`` (a copy where links cannot be made)."""
        names.link(trainer, filepath, linkpath)

    def _remove_if_unkept(self, trainer, previous: str, current: str) -> None:
        if names.should_remove(trainer, self.dirpath, previous, current):
            self._remove_checkpoint(trainer, previous)

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        """Collective: global rank 0 removes the file (or sharded folder), then every rank goes on."""
        if trainer.is_global_zero:
            names.remove(filepath)
        trainer.strategy.barrier()

    def file_exists(self, filepath: str, trainer) -> bool:
        """Whether ``filepath`` exists on global rank 0 (every rank gets the same answer)."""
        return trainer.strategy.any_rank(trainer.is_global_zero and os.path.exists(filepath))

    def _unused_name(self, trainer, candidates: dict[str, Any], replaced: str | None = None) -> str:
        """The checkpoint's name, with Lightning's version counter (``NAME-v1``, ...) while it is taken
        (except by ``replaced``, about to go)."""
        path = self.format_checkpoint_name(candidates)
        if self._enable_version_counter:
            version = self.STARTING_VERSION
            while self.file_exists(path, trainer) and path != replaced:
                path = self.format_checkpoint_name(candidates, ver=version)
                version += 1
        return path

    # ------------------------------------------------------------------ names
    def _format_checkpoint_name(self, filename: str | None, metrics: dict[str, Any], prefix: str | None = None,
                                auto_insert_metric_name: bool = True) -> str:
        """``filename`` (default ``"{epoch}-{step}"``) filled in from ``metrics``; ``prefix`` first."""
        name = names.fill_template(filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}", metrics,
                                   auto_insert_metric_name, self.CHECKPOINT_EQUALS_CHAR)
        return self.CHECKPOINT_JOIN_CHAR.join([prefix, name]) if prefix is not None else name

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None,
                               prefix: str | None = None, *, epoch: int | None = None, step: int | None = None) -> str:
        """The checkpoint path for ``metrics``, as Lightning's: ``"{epoch}-{val_loss:.2f}"`` gives
        ``epoch=3-val_loss=0.12`` with ``auto_insert_metric_name`` (a name not in ``metrics``
        reads 0); ``-v{ver}`` after it, then the extension, inside ``dirpath`` when set. ``epoch``
        and ``step`` (zerotrain's keywords) stand for those metrics."""
        if epoch is not None or step is not None:
            metrics = {**metrics, **{k: v for k, v in (("epoch", epoch), ("step", step)) if v is not None}}
        name = self._format_checkpoint_name(filename or self.filename, metrics, prefix=prefix,
                                            auto_insert_metric_name=self.auto_insert_metric_name)
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        name += self._extension()
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _extension(self) -> str:
        return ".safetensors" if self.save_weights_only else self.FILE_EXTENSION

    def _find_last_checkpoints(self, trainer) -> set[str]:
        """The ``last`` checkpoints (``last.ckpt``, ``last-v1.ckpt``, ...) in this callback's folder."""
        return names.last_checkpoints(self.dirpath or names.default_dirpath(trainer), self.CHECKPOINT_NAME_LAST,
                                      self._extension())

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Lightning's: write ``best_k_models`` (path -> score) to ``filepath`` (default
        ``dirpath/best_k_models.yaml``)."""
        import yaml

        filepath = filepath if filepath is not None else os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as f:
            yaml.dump({k: float(v) for k, v in self.best_k_models.items()}, f)

    def _note_differences(self) -> None:
        """Say once, at the start of the first fit (global rank 0), where this callback saves
        differently from Lightning's with the same arguments."""
        log.info("ModelCheckpoint(dirpath=%r) differs from Lightning's: a checkpoint is %s", self.dirpath,
                 "one consolidated .safetensors file of the weights, not a .ckpt file" if self.save_weights_only
                 else "a folder NAME.ckpt (one shard file per rank) under a sharded strategy, as Lightning's "
                 "DeepSpeed strategy, with dirpath/latest naming the newest")

    def _save_weights(self, trainer, path: str) -> None:
        """Weights only, as one consolidated safetensors file (every key of the module's state
        dict at full shape, loadable by plain PyTorch): the sharded checkpoint is written to a
        scratch directory by every rank, consolidated by rank 0 one tensor at a time
        (``trainer/checkpoint/consolidate.py``), then removed. Not a resume point: ``latest`` does not move."""
        from ..trainer.checkpoint.consolidate import consolidate

        scratch = os.path.join(self.dirpath, f".{os.path.basename(path)}.shards")
        trainer.save_checkpoint(scratch, update_latest=False)
        error = None
        try:
            if trainer.is_global_zero:
                try:
                    consolidate(scratch, path)
                except CheckpointError as exc:  # raised on every rank below, not on rank 0 alone
                    error = f"rank 0: {exc}"
                except Exception as exc:  # noqa: BLE001 - the same: no rank may be left waiting below
                    error = f"rank 0: {exc!r}"
        finally:
            if trainer.is_global_zero:
                shutil.rmtree(scratch, ignore_errors=True)
        error = trainer.strategy.broadcast(error)
        if error:
            raise CheckpointError(f"saving weights {path!r} failed: {error}")

