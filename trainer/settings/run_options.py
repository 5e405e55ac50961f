"""Lightning's Trainer arguments about how a run is carried out rather than what it trains:
``barebones``, ``benchmark``, ``inference_mode``, ``reload_dataloaders_every_n_epochs`` and
``profiler``; and the opt-out defaults (None: on) of the features ``barebones`` switches off.
Each refusal reads as Lightning's (a ConfigError, which is a ValueError as Lightning's)."""
from __future__ import annotations

import logging
import numbers
from datetime import timedelta
from typing import Any

import torch

from ..errors import ConfigError
from ..utilities import PossibleUserWarning, rank_zero_warn

log = logging.getLogger("zerotrain")


#: the features barebones switches off: (argument, the value that means off, why)
_OPT_OUTS = (
    ("enable_checkpointing", False, "Checkpointing can impact raw speed"),
    ("logger", False, "Logging can impact raw speed"),
    ("enable_progress_bar", False, "The progress bar can impact raw speed"),
    ("log_every_n_steps", 0, "Logging can impact raw speed"),
    ("enable_model_summary", False, "Model summary can impact raw speed"),
    ("num_sanity_val_steps", 0, "Sanity checking can impact raw speed"),
)
#: features only ever switched on by the user
_OPT_INS = (
    ("fast_dev_run", "Development run is not meant for raw speed evaluation"),
    ("detect_anomaly", "Anomaly detection can impact raw speed"),
    ("profiler", "Profiling can impact raw speed"),
)
#: the opt-out features' values when not given (None) outside barebones, as Lightning's
_DEFAULTS = {"enable_checkpointing": True, "logger": True, "enable_progress_bar": True, "enable_model_summary": True,
             "num_sanity_val_steps": 2, "log_every_n_steps": 50}


def feature_flags(barebones: bool, **given: Any) -> dict[str, Any]:
    """The opt-out features' values: Lightning's defaults for those left None, or under
    ``barebones=True`` every one off (one asked for explicitly is refused, as Lightning)."""
    if not barebones:
        return {k: (_DEFAULTS.get(k) if v is None else v) for k, v in given.items()}
    for name, off, why in _OPT_OUTS:
        value = given.get(name)
        if value is not None and value is not False and value != off:
            raise ConfigError(f"`Trainer(barebones=True, {name}={value!r})` was passed. {why} so it is disabled "
                                 "in barebones mode.")
    for name, why in _OPT_INS:
        value = given.get(name)
        if value is not None and value is not False and value != 0:
            raise ConfigError(f"`Trainer(barebones=True, {name}={value!r})` was passed. {why} so it is disabled "
                                 "in barebones mode.")
    log.info("You are running in `Trainer(barebones=True)` mode: checkpointing, the progress bar, the model summary, "
             "logging, sanity checking, fast_dev_run, anomaly detection and profiling are off.")
    flags = {name: off for name, off, _ in _OPT_OUTS}
    return {k: flags.get(k, v) for k, v in given.items()}


def set_benchmark(benchmark: Any, deterministic: bool) -> bool | None:
    """``benchmark``: True/False sets ``torch.backends.cudnn.benchmark``; None leaves the
    session's value, except that ``deterministic=True`` turns it off (as Lightning). Checked by
    the declaration (``declaration.py``)."""
    if deterministic and benchmark:
        log.warning("Trainer(deterministic=True, benchmark=True): cudnn's benchmark picks algorithms by timing, "
                    "so results may not be reproducible")
    if benchmark is None and deterministic:
        benchmark = False
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark
    return benchmark


def check_run_options(inference_mode: Any, reload_every: Any, profiler: Any) -> None:
    """``inference_mode`` a bool, ``reload_dataloaders_every_n_epochs`` an int >= 0; ``profiler``:
    None, ``"simple"`` or a Profiler (``compat/profilers.profiler_of``)."""
    if not isinstance(inference_mode, bool):
        raise ConfigError(f"Trainer: inference_mode={inference_mode!r}; valid: True (torch.inference_mode) or False "
                          "(torch.no_grad) for evaluation")
    if isinstance(reload_every, bool) or not isinstance(reload_every, int) or reload_every < 0:
        raise ConfigError(f"`reload_dataloaders_every_n_epochs` should be an int >= 0, got {reload_every}. Trainer: "
                          f"reload_dataloaders_every_n_epochs={reload_every!r}; valid: an int >= 0 (0: never)")
    from ..compat.lightning.profilers import profiler_of

    try:
        profiler_of(profiler)
    except ValueError as exc:
        raise ConfigError(f"Trainer: {exc}; the ResourceMonitor callback breaks a step's time down by phase") from None


def default_max_epochs(max_epochs: int | None, max_steps: int, callbacks: list) -> int | None:
    """Lightning's rule for ``max_epochs=None``: 1000 when nothing else ends the run (no
    ``max_steps``, no Timer, said out loud), else -1 (no limit)."""
    from ...callbacks.timer import Timer

    if max_epochs is not None:
        return max_epochs
    if max_steps == -1 and not any(isinstance(cb, Timer) for cb in callbacks):
        rank_zero_warn("`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch limit, set "
                       "`max_epochs=-1`.", PossibleUserWarning)
        return 1000
    return -1


def device_count(devices: Any, accelerator: str) -> Any:
    """Lightning's forms of ``devices``: "auto" or -1 / "-1" (every visible device: the GPUs, or
    one CPU process), an int or a string of one ("2"), or a list of device indices (its length);
    anything else is returned for the Trainer's check to refuse."""
    every = torch.cuda.device_count() if accelerator != "cpu" and torch.cuda.is_available() else 1
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return every
        if "," in text:
            devices = [int(d) for d in text.split(",") if d.strip()] if all(
                d.strip().isdigit() for d in text.split(",") if d.strip()) else devices
        elif text.lstrip("-").isdigit():
            devices = int(text)
    if isinstance(devices, (list, tuple)) and devices and all(isinstance(d, int) for d in devices):
        return len(devices)
    return every if devices == -1 and not isinstance(devices, bool) else devices


_VALID_INTERVAL = ("valid: an int (steps), a float in (0, 1] (a fraction of an epoch), a duration ('DD:HH:MM:SS', "
                   "a datetime.timedelta or a dict of timedelta keywords) or None")


def val_check_seconds(value: Any) -> float | None:
    """``val_check_interval``: None, an int >= 1 (steps), a float in (0, 1] (a fraction of the
    epoch), or - Lightning 2.6's time-based forms - ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict
    of ``timedelta`` keywords: its seconds are returned (validation once that much wall-clock time
    passed since the last one, checked after each step); None for the other forms."""
    from ...callbacks.timer import parse_duration
    from .arguments import invalid_value

    if isinstance(value, (str, timedelta, dict)):
        try:
            seconds = parse_duration(value).total_seconds()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"Trainer: val_check_interval={value!r}; {_VALID_INTERVAL}") from exc
        if seconds <= 0:
            raise ConfigError(f"Trainer: val_check_interval={value!r} is no time; valid: a duration > 0")
        return seconds
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ConfigError(f"Trainer: val_check_interval={value!r}; {_VALID_INTERVAL}")
    if isinstance(value, float) and not 0 < value <= 1:
        raise ConfigError(f"{invalid_value('val_check_interval', value)} Trainer: val_check_interval={value!r} as a "
                          "float is a fraction of an epoch in (0, 1]; give an int for a number of steps")
    if isinstance(value, int) and value < 1:
        raise ConfigError(f"Trainer: val_check_interval={value!r} must be an integer >= 1")
    return None
