"""Lightning's ``Tuner`` (``lightning.pytorch.tuner.tuning``): ``lr_find`` and ``scale_batch_size``
put their callback first in the Trainer's callbacks, run ``fit`` (the search happens in its
``on_fit_start``), and take the callback out again. Where Lightning's callback then raises its
exit exception, ours ends the fit without training (``exit_fit``: no training batch and no sanity
check for the rest of that fit, the Tuner puts both back), so ``on_fit_end`` and ``teardown`` run."""
from __future__ import annotations

from typing import Any

from ...trainer.errors import MisconfigurationException
from .batch_size_finder import BatchSizeFinder, distributed
from .lr_finder import LearningRateFinder, _LRFinder

_METHODS = ("fit", "validate", "test", "predict")


def exit_fit(trainer: Any) -> None:
    """The running fit trains no batch and runs no sanity check after this (its callbacks'
    ``on_fit_end`` and ``teardown`` still run)."""
    trainer.limit_train_batches, trainer.num_sanity_val_steps = 0, 0


def _check_tuner_configuration(train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
                               method: str = "fit") -> None:
    if method not in _METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {_METHODS}.")
    if method == "fit" and dataloaders is not None:
        raise MisconfigurationException(f"In tuner with method={method!r}, `dataloaders` argument should be None, "
                                        "please consider setting `train_dataloaders` and `val_dataloaders` instead.")
    if method != "fit" and (train_dataloaders is not None or val_dataloaders is not None):
        raise MisconfigurationException(f"In tuner with `method`={method!r}, `train_dataloaders` and "
                                        "`val_dataloaders` arguments should be None, please consider setting "
                                        "`dataloaders` instead.")


class Tuner:
    """Tune a Trainer's module before training: ``Tuner(trainer).lr_find(model)`` /
    ``.scale_batch_size(model)``, Lightning's arguments and defaults."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def _fit_with(self, callback: Any, model: Any, train_dataloaders: Any, val_dataloaders: Any,
                  datamodule: Any) -> None:
        t = self._trainer
        kept = (t.limit_train_batches, t.num_sanity_val_steps)
        callback._early_exit = True
        t.callbacks = [callback] + list(t.callbacks)
        t.hooks.callbacks = t.callbacks
        try:
            t.fit(model, train_dataloaders, val_dataloaders, datamodule)
        finally:
            t.callbacks = t.hooks.callbacks = [cb for cb in t.callbacks if cb is not callback]
            t.limit_train_batches, t.num_sanity_val_steps = kept

    def scale_batch_size(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
                         dataloaders: Any = None, datamodule: Any = None, method: str = "fit", mode: str = "power",
                         steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                         batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192) -> int | None:
        """The largest batch size (``mode`` ``'power'`` or ``'binsearch'``) whose trials of
        ``steps_per_trial`` steps do not run out of memory; left set on the module."""
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        t = self._trainer
        if distributed(t):
            raise ValueError("Tuning the batch size is currently not supported with distributed strategies.")
        if any(isinstance(cb, BatchSizeFinder) for cb in t.callbacks):
            raise ValueError("Trainer is already configured with a `BatchSizeFinder` callback.Please remove it if you "
                             "want to use the Tuner.")
        assert 0.0 <= margin < 1.0, f"`margin` should be between 0 and 1. Found {margin=}"
        if method != "fit":
            raise NotImplementedError(f"Tuner.scale_batch_size(method={method!r}): zerotrain searches the batch "
                                      "size of fit only; valid: method='fit'")
        finder = BatchSizeFinder(mode=mode, steps_per_trial=steps_per_trial, init_val=init_val,
                                 max_trials=max_trials, batch_arg_name=batch_arg_name, margin=margin, max_val=max_val)
        self._fit_with(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_batch_size

    def lr_find(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None, dataloaders: Any = None,
                datamodule: Any = None, method: str = "fit", min_lr: float = 1e-8, max_lr: float = 1,
                num_training: int = 100, mode: str = "exponential", early_stop_threshold: float | None = 4.0,
                update_attr: bool = True, attr_name: str = "") -> _LRFinder | None:
        """The learning-rate range test; its result (``results``, ``suggestion()``, ``plot()``),
        the suggestion set on the module's ``lr``/``learning_rate`` with ``update_attr``."""
        if method != "fit":
            raise MisconfigurationException("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        if any(isinstance(cb, LearningRateFinder) for cb in self._trainer.callbacks):
            raise ValueError("Trainer is already configured with a `LearningRateFinder` callback.Please remove it if "
                             "you want to use the Tuner.")
        finder = LearningRateFinder(min_lr=min_lr, max_lr=max_lr, num_training_steps=num_training, mode=mode,
                                    early_stop_threshold=early_stop_threshold, update_attr=update_attr,
                                    attr_name=attr_name)
        self._fit_with(finder, model, train_dataloaders, val_dataloaders, datamodule)
        return finder.optimal_lr
