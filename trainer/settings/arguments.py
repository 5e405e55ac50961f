"""The Trainer's argument checks, the callbacks Lightning adds for its arguments (``max_time``:
a Timer; ``enable_model_summary``: a ModelSummary), ``fast_dev_run``'s settings and the default
callbacks and loggers. Each error reads ``Trainer: field=value ...``."""
from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any

from ..errors import ConfigError

log = logging.getLogger("zerotrain")


def invalid_value(name: str, value: Any) -> str:
    """Lightning's sentence for a batch limit or interval out of range (its tests match it)."""
    return f"You have passed invalid value {value} for {name}, it has to be in [0.0, 1.0] or an int."


def check_limit(name: str, value: Any, allow_zero: bool) -> Any:
    """``limit_*_batches``: None, a count (int >= 0) or a fraction of the loader (float in [0, 1]);
    returned as the Trainer keeps it: a whole float above 1 (``1e50``) is that count, as Lightning."""
    if value is None:
        return None
    if isinstance(value, float) and value > 1.0 and math.isfinite(value) and value % 1.0 == 0:
        value = int(value)
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
        isinstance(value, float) and 0.0 <= value <= 1.0)
    if not ok:
        raise ConfigError(f"{invalid_value(name, value)} Trainer: {name}={value!r}; valid: None, an int >= 0 "
                          "(batches) or a float in [0.0, 1.0] (fraction of the loader)")
    if not allow_zero and value == 0:
        raise ConfigError(f"Trainer: {name}={value!r} leaves no batch to train on; valid: an int >= 1 "
                          "or a float in (0.0, 1.0]")
    return value


def positive_int(name: str, value: Any, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"Trainer: {name}={value!r} must be an integer >= {minimum}")


def positive_number(name: str, value: Any, what: str, allow_none: bool = True, allow_zero: bool = False) -> None:
    """A finite number > 0 (>= 0 with ``allow_zero``; not a bool: True is no number of seconds), or
    None when allowed."""
    if value is None and allow_none:
        return
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0
            or (value == 0 and not allow_zero)):
        raise ConfigError(f"Trainer: {name}={value!r} must be a finite number {'>=' if allow_zero else '>'} 0 ({what})"
                          + (", or None" if allow_none else ""))


def check_max_limits(max_epochs: Any, max_steps: Any) -> None:
    """``max_epochs``: None, -1 (no limit) or an int >= 0; ``max_steps``: -1 or an int >= 0; refused
    in Lightning's words (its tests match them), then ours."""
    for name, value, none_ok in (("max_epochs", max_epochs, True), ("max_steps", max_steps, False)):
        if value is None and none_ok:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(f"`{name}` must be a non-negative integer or -1. You passed in {value!r}. Trainer: "
                              f"{name}={value!r}; valid: -1 (no limit) or an integer >= 0")


def check_val_schedule(val_check_interval: Any, check_val_every_n_epoch: Any) -> None:
    """A fraction of an epoch means nothing when validation counts the batches of the whole run."""
    if check_val_every_n_epoch is None and isinstance(val_check_interval, float):
        raise ConfigError("`val_check_interval` should be an integer or a time-based duration (str 'DD:HH:MM:SS', "
                          "datetime.timedelta, or dict kwargs for timedelta) when `check_val_every_n_epoch=None`. "
                          f"Trainer: val_check_interval={val_check_interval!r}, check_val_every_n_epoch=None")


#: Lightning's ``gradient_clip_algorithm`` choices (None: "norm")
CLIP_ALGORITHMS = ("norm", "value")


def check_lightning_args(fast_dev_run: Any, num_sanity_val_steps: Any, check_val_every_n_epoch: Any,
                          min_epochs: Any, min_steps: Any, overfit_batches: Any, clip_algorithm: Any) -> None:
    """Lightning's debugging and stopping arguments, refused as Lightning refuses them."""
    if not isinstance(fast_dev_run, (bool, int)) or fast_dev_run < 0:
        raise ConfigError(f"fast_dev_run={fast_dev_run!r} is not a valid configuration. It should be >= 0. "
                          f"Trainer: fast_dev_run={fast_dev_run!r}; valid: a bool or an int >= 0 (batches)")
    if num_sanity_val_steps is not None and (isinstance(num_sanity_val_steps, bool) or not isinstance(
            num_sanity_val_steps, int) or num_sanity_val_steps < -1):
        raise ConfigError(f"Trainer: num_sanity_val_steps={num_sanity_val_steps!r}; valid: an int >= 0 "
                          "(batches), -1 (the whole validation loader) or None (2)")
    n = check_val_every_n_epoch
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):  # Lightning's words first
        raise ConfigError(f"`check_val_every_n_epoch` should be an integer, found {n!r}. Trainer: "
                          f"check_val_every_n_epoch={n!r}; valid: None or an integer >= 1")
    positive_int("check_val_every_n_epoch", n, allow_none=True)
    positive_int("min_epochs", min_epochs, allow_none=True, minimum=0)
    positive_int("min_steps", min_steps, allow_none=True, minimum=0)
    check_limit("overfit_batches", overfit_batches, allow_zero=True)
    if clip_algorithm is not None and str(clip_algorithm).lower() not in CLIP_ALGORITHMS:  # any case, as Lightning
        raise ConfigError(f"`gradient_clip_algorithm` {clip_algorithm} is invalid. Allowed algorithms: "
                          f"{list(CLIP_ALGORITHMS)}. Trainer: gradient_clip_algorithm={clip_algorithm!r}; valid "
                          f"choices: {', '.join(CLIP_ALGORITHMS)} (None: norm)")


def check_clip_val(value: Any) -> None:
    """``gradient_clip_val``: None or a number (Lightning's TypeError for anything else), >= 0."""
    if value is not None and not isinstance(value, numbers.Real):  # a bool: refused below, as no threshold
        raise TypeError(f"`gradient_clip_val` should be an int or a float. Got {value}. Trainer: "
                        f"gradient_clip_val={value!r}; valid: None or a number >= 0 (0: off)")
    positive_number("gradient_clip_val", value, "the clipping threshold; 0: off, as Lightning", allow_zero=True)


def lightning_callbacks(callbacks: list, max_time: Any, enable_model_summary: bool) -> list:
    """The callbacks Lightning adds for its arguments: a ``Timer(max_time, interval="step")``
    unless the user gave a Timer (then ``max_time`` is ignored, said out loud, as Lightning), and
    a ``ModelSummary`` unless disabled or given."""
    from ...callbacks.summary import ModelSummary
    from ...callbacks.timer import Timer, parse_duration

    if max_time is not None:
        try:
            duration = parse_duration(max_time)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Trainer: max_time={max_time!r}; valid: 'DD:HH:MM:SS', a datetime.timedelta or "
                              "a dict of timedelta keywords") from exc
        if any(isinstance(c, Timer) for c in callbacks):
            log.info("Ignoring `Trainer(max_time=%r)`, callbacks list already contains a Timer.", max_time)
        else:
            callbacks.append(Timer(duration=duration, interval="step"))
    if enable_model_summary and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(ModelSummary())
    return callbacks


def fast_dev_run_flags(trainer: Any, n: int, callbacks: list) -> list:
    """Lightning's ``fast_dev_run=n``: n training batches (max_steps=n, one epoch), n batches of
    every evaluation loader (unless ``overfit_batches`` sets them), no sanity check, validation
    after the epoch, and no logging or checkpointing (the ModelCheckpoints stay, as Lightning's,
    and save nothing: ``ModelCheckpoint._should_skip_saving_checkpoint``). Sets ``trainer``'s
    limits; returns the callbacks."""
    if not trainer.overfit_batches:
        trainer.limit_train_batches = trainer.limit_val_batches = n
    trainer.limit_test_batches = trainer.limit_predict_batches = n
    trainer.max_steps, trainer.max_epochs = n, 1
    trainer.num_sanity_val_steps, trainer.val_check_interval, trainer.check_val_every_n_epoch = 0, 1.0, 1
    log.info("Running in fast_dev_run mode: will run the requested loop using %d batch(es). Logging and "
             "checkpointing is suppressed.", n)
    return callbacks


def default_callbacks(strategy: Any, root_dir: str, callbacks: list, checkpointing: bool, progress: bool) -> list:
    """The callbacks the Trainer adds unless given: a ModelCheckpoint (Lightning's defaults) under
    ``root_dir/checkpoints``, a progress bar, and the strategy's comms logger when it asks for one;
    the ModelCheckpoints last, as Lightning orders them."""
    from ...callbacks.checkpoint import ModelCheckpoint
    from ...callbacks.measure.comms import comms_logger_for
    from ...callbacks.progress import ProgressBar, TQDMProgressBar

    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        default = ModelCheckpoint(dirpath=os.path.join(root_dir, "checkpoints"))
        default.made_by_trainer = True
        callbacks.append(default)
    bars = [c for c in callbacks if isinstance(c, ProgressBar)]
    if len(bars) > 1:
        raise ConfigError("You added multiple progress bar callbacks to the Trainer, but currently only one progress "
                          "bar is supported.")
    if bars and not progress:
        raise ConfigError(f"Trainer was configured with `enable_progress_bar=False` but found "
                          f"`{type(bars[0]).__name__}` in callbacks list.")
    if progress and not bars:
        callbacks.append(TQDMProgressBar())
    callbacks = comms_logger_for(strategy, callbacks)  # strategy option comms_logger=True
    # Lightning's order: the checkpoint callbacks last, so that they save what the others did
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + \
        [c for c in callbacks if isinstance(c, ModelCheckpoint)]


def make_loggers(root_dir: str, logger: Any) -> list:
    """``Trainer(logger=)``: True is a TensorBoardLogger under ``root_dir/lightning_logs/version_<n>``
    (Lightning's default), False/None none, else the logger or loggers given."""
    if logger is False or logger is None:
        return []
    if logger is True:
        from ...callbacks.loggers.tensorboard import TensorBoardLogger
        return [TensorBoardLogger(root_dir)]
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]
