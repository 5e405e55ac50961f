"""Lightning's batch-size search (``lightning.pytorch.tuner.batch_size_scaling`` and the
``BatchSizeFinder`` callback), for ``fit``: inside ``on_fit_start`` the state is saved, then
trials of ``steps_per_trial`` steps each run the fit's training (``trainer.fit_loop.run()``, with
no callbacks or loggers) at growing batch sizes, set on the module's (or datamodule's)
``batch_arg_name`` and the training loader requested again each time. ``'power'`` doubles the size
until a trial runs out of memory; ``'binsearch'`` then bisects between the last size that ran and
the first that did not, and takes ``margin`` off the result. Afterwards the callbacks, loggers,
limits, and from the checkpoint the weights, optimizer state and loop counters are put back; the
size found stays set for the real run.

One process only (Lightning's rule: not with distributed strategies), and the data must come from
the module or datamodule hooks. The evaluation stages (Lightning also scales ``validate``/``test``/
``predict`` batch sizes) are not searched: said once, and skipped."""
from __future__ import annotations

import gc
import logging
import os
import uuid
from typing import Any

import torch

from ...trainer.checkpoint import protocol as checkpointing
from ...trainer.errors import MisconfigurationException
from ...trainer.utilities import rank_zero_info, rank_zero_warn
from ..base import Callback, DummyLogger
from .attrs import lightning_getattr, lightning_hasattr, lightning_setattr
from .lr_finder import _remove_checkpoint, _use_callbacks

log = logging.getLogger("zerotrain")

_OOM_MESSAGES = ("CUDA out of memory.", "CUDA error: out of memory", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                 "DefaultCPUAllocator: can't allocate memory")


def is_oom_error(exception: BaseException) -> bool:
    """A RuntimeError that says memory ran out (CUDA, cuDNN's workspace, the CPU allocator)."""
    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exception, RuntimeError) and len(exception.args) == 1 and any(
        m in str(exception.args[0]) for m in _OOM_MESSAGES)


def distributed(trainer: Any) -> bool:
    """The Trainer runs (or will run) more than one process."""
    return trainer.world_size > 1 or trainer.num_devices * trainer.num_nodes > 1


def _collect_garbage() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Search:
    """One search's state: the Trainer settings it changes and puts back, and the trial runner."""

    def __init__(self, trainer: Any, batch_arg_name: str, steps_per_trial: int, max_val: int) -> None:
        self.trainer, self.name, self.max_val = trainer, batch_arg_name, max_val
        self.saved = {"loggers": list(trainer.loggers), "callbacks": list(trainer.callbacks),
                      "max_steps": trainer.max_steps, "limit_train_batches": trainer.limit_train_batches,
                      "limit_val_batches": trainer.limit_val_batches}
        self.loop_state = trainer.state.state_dict()
        trainer.loggers = [DummyLogger()] if trainer.loggers else []
        _use_callbacks(trainer, [])
        trainer.limit_train_batches, trainer.limit_val_batches = 1.0, steps_per_trial
        trainer.fit_loop.max_steps = steps_per_trial

    def restore(self) -> None:
        t, saved = self.trainer, self.saved
        t.loggers = saved["loggers"]
        _use_callbacks(t, saved["callbacks"])
        t.fit_loop.max_steps = saved["max_steps"]
        t.limit_train_batches, t.limit_val_batches = saved["limit_train_batches"], saved["limit_val_batches"]
        t.state.load_state_dict(self.loop_state)
        t.should_stop = False
        t.fit_loop.setup_data()
        t.fit_loop.epoch_loop.val_loop.setup_data()

    def at_limit(self, size: int) -> bool:
        if size >= self.max_val:
            rank_zero_info(f"Reached the maximum batch size limit of {self.max_val}. Stopping search.")
        return size >= self.max_val

    def fits(self) -> bool:
        """A trial: ``steps_per_trial`` steps from the saved loop position; False where it ran out
        of memory (any other error is raised)."""
        _collect_garbage()
        self.trainer.state.load_state_dict(self.loop_state)
        try:
            self.trainer.fit_loop.run()
        except RuntimeError as exc:
            if not is_oom_error(exc):
                raise
            _collect_garbage()
            return False
        return True

    def adjust(self, factor: float = 1.0, value: int | None = None, desc: str | None = None) -> tuple[int, bool]:
        """Set the next size (``value``, else the current one times ``factor``, capped at
        ``max_val``) and request the loader again; returns it and whether it changed. A size that
        already covers the whole dataset stays."""
        t = self.trainer
        size = lightning_getattr(t.lightning_module, self.name)
        t.fit_loop.setup_data()
        dataset = getattr(t.train_dataloader, "dataset", None)
        try:
            length = len(dataset) if dataset is not None else None
        except TypeError:
            length = None
        if length is not None and size >= length:
            rank_zero_info(f"The batch size {size} is greater or equal than the length of your dataset: {length}.")
            return size, False
        new = value if value is not None else int(size * factor)
        if new > self.max_val:
            if desc:
                rank_zero_info(f"Batch size {new} exceeds max_val limit {self.max_val}, capping at {self.max_val}")
            new = self.max_val
        if desc:
            rank_zero_info(f"Batch size {size} {desc}, trying batch size {new}")
        lightning_setattr(t.lightning_module, self.name, new)
        t.fit_loop.setup_data()
        t.fit_loop.epoch_loop.val_loop.setup_data()  # as Lightning's: both loaders at the new size
        return new, new != size


def _power(search: _Search, size: int, max_trials: int) -> int:
    """Double until a trial runs out of memory (then half of that size) or ``max_trials`` ran."""
    any_success = False
    for i in range(max_trials):
        if search.at_limit(size):
            break
        if search.fits():
            if i + 1 >= max_trials:
                break
            size, changed = search.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
            any_success = True
        else:
            size, _ = search.adjust(factor=0.5, desc="failed")
            if any_success:
                break
    return size


def _binsearch(search: _Search, size: int, max_trials: int, margin: float) -> int:
    """Double until out of memory, then bisect between the last size that ran and the first that
    did not; ``margin`` comes off the result."""
    low, high, count = 1, None, 0
    while not search.at_limit(size):
        if search.fits():
            count += 1
            if count >= max_trials:
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size, changed = search.adjust(value=(high + low) // 2, desc="succeeded")
            else:
                size, changed = search.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
        else:
            high = size
            size, _ = search.adjust(value=(high + low) // 2, desc="failed")
            if high - low <= 1:
                break
    if margin > 0:
        reduced = max(1, int(size * (1 - margin)))
        if reduced != size:
            rank_zero_info(f"Applying margin of {margin:.1%}, reducing batch size from {size} to {reduced}")
            size = reduced
            lightning_setattr(search.trainer.lightning_module, search.name, size)
    return size


def _scale_batch_size(trainer: Any, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2,
                      max_trials: int = 25, batch_arg_name: str = "batch_size", margin: float = 0.05,
                      max_val: int = 8192) -> int | None:
    """The search (see the module's docstring) inside the running fit; returns the size found
    (None under ``fast_dev_run``), which stays set on the module."""
    assert 0.0 <= margin < 1.0, f"`margin` should be between 0 and 1. Found {margin=}"
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
        return None
    path = os.path.join(trainer.default_root_dir, f".scale_batch_size_{uuid.uuid4()}.ckpt")
    trainer.save_checkpoint(path)
    search = _Search(trainer, batch_arg_name, steps_per_trial, max_val)
    try:
        size, _ = search.adjust(value=init_val)
        size = _power(search, size, max_trials) if mode == "power" else _binsearch(search, size, max_trials, margin)
        _collect_garbage()
        log.info("Finished batch size finder, will continue with full run using batch size %s", size)
    finally:
        search.restore()
        checkpointing.load(trainer, path)
        _remove_checkpoint(trainer, path)
    return size


class BatchSizeFinder(Callback):
    """As Lightning 2.6's, for ``fit``: the search runs in ``on_fit_start`` (``scale_batch_size``),
    the result in ``optimal_batch_size``; ``Tuner.scale_batch_size`` uses it and ends the fit
    right after (``_early_exit``)."""

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                 batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"`mode` should be either of {self.SUPPORTED_MODES}")
        assert 0.0 <= margin < 1.0, f"`margin` should be between 0 and 1. Found {margin=}"
        self.optimal_batch_size: int | None = init_val
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name, self._margin, self._max_val = max_trials, batch_arg_name, margin, max_val
        self._early_exit = False
        self._said_eval = False

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if distributed(trainer):
            raise MisconfigurationException("The Batch size finder is not supported with distributed strategies.")
        if stage == "fit" and trainer.fit_loop.loaders_given:
            raise MisconfigurationException(
                "The Batch size finder cannot be used with dataloaders passed directly to `.fit()`. Please disable the "
                "feature or incorporate the dataloader into your LightningModule or LightningDataModule.")
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            raise MisconfigurationException(f"Field {self._batch_arg_name} not found in `model`, `datamodule`, nor "
                                            "their `hparams` attributes.")
        hparams = getattr(pl_module, "hparams", None)
        if hasattr(pl_module, self._batch_arg_name) and hparams is not None and self._batch_arg_name in hparams:
            rank_zero_warn(f"Field `model.{self._batch_arg_name}` and `model.hparams.{self._batch_arg_name}` are "
                           f"mutually exclusive! `model.{self._batch_arg_name}` will be used as the initial batch "
                           "size for scaling. If this is not the intended behavior, please remove either one.")

    def scale_batch_size(self, trainer: Any, pl_module: Any) -> None:
        self.optimal_batch_size = _scale_batch_size(trainer, self._mode, self._steps_per_trial, self._init_val,
                                                    self._max_trials, self._batch_arg_name, self._margin,
                                                    self._max_val)
        if self._early_exit:
            from .tuner import exit_fit

            exit_fit(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.scale_batch_size(trainer, pl_module)

    def _eval_stage(self, trainer: Any) -> None:
        if not self._said_eval and not trainer.sanity_checking and trainer.state.fn != "fit":
            self._said_eval = True
            log.warning("BatchSizeFinder: zerotrain searches the batch size in fit only; %s keeps batch size %s",
                        trainer.state.fn, self.optimal_batch_size)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_stage(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_stage(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_stage(trainer)
