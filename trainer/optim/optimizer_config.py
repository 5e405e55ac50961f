"""``configure_optimizers()``'s output read as Lightning 2.x reads it (``lightning.pytorch.core.optimizer``),
in its two stages: :func:`split_config` takes the optimizers, the schedulers and the monitor out of
any accepted form; :func:`automatic_configs` / :func:`manual_configs` turn each scheduler (or
Lightning's scheduler dict) into an :class:`LRSchedulerConfig`; :func:`check_configs` refuses what
Lightning refuses. Accepted: an optimizer, a list or tuple of them, ``([optimizers], [schedulers])``,
a dict ``{"optimizer", "lr_scheduler", "monitor"}`` or a list of such dicts, and zerotrain's own
``(optimizer, scheduler)``, whose scheduler steps every step (Lightning refuses that form).
Lightning's names are kept as aliases (``_configure_optimizers``, ...) under ``zerotrain.core.optimizer``."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

#: Lightning's error for several optimizers under automatic optimization (its wording)
MULTIPLE_AUTOMATIC = ("Training with multiple optimizers is only supported with manual optimization. Set "
                      "`self.automatic_optimization = False`, then access your optimizers in `training_step` "
                      "with `opt1, opt2, ... = self.optimizers()`.")
OPTIMIZER_IDX = ("Training with multiple optimizers is only supported with manual optimization. Remove the "
                 "`optimizer_idx` argument from `training_step`, set `self.automatic_optimization = False` and "
                 "access your optimizers in `training_step` with `opt1, opt2, ... = self.optimizers()`.")
_UNKNOWN = ("Unknown configuration for model optimizers. Output from `model.configure_optimizers()` should be one "
            "of:\n * `Optimizer`\n * [`Optimizer`]\n * ([`Optimizer`], [`LRScheduler`])\n"
            ' * {"optimizer": `Optimizer`, (optional) "lr_scheduler": `LRScheduler`}\n'
            " * (`Optimizer`, `LRScheduler`) (zerotrain's form: the scheduler steps every step)\n")
_PLATEAU = torch.optim.lr_scheduler.ReduceLROnPlateau


class MultipleOptimizersError(ConfigError, RuntimeError):
    """Several optimizers under automatic optimization: a ConfigError, and the RuntimeError Lightning raises."""


@dataclass
class LRSchedulerConfig:
    """One LR scheduler and when the Trainer steps it (Lightning's fields and defaults)."""

    scheduler: Any
    #: what the LearningRateMonitor calls this scheduler's optimizer
    name: str | None = None
    interval: str = "epoch"
    #: step every ``frequency`` intervals
    frequency: int = 1
    #: stepped with the monitored metric (a ReduceLROnPlateau, or a custom one that says so)
    reduce_on_plateau: bool = False
    #: the ``callback_metrics`` name it steps on, and whether a missing one is an error (``strict``)
    #: or a skipped step with a warning
    monitor: str | None = None
    strict: bool = True


def _is_optimizer(x: Any) -> bool:
    return isinstance(x, torch.optim.Optimizer)


def _check_dict(d: dict) -> None:
    extra = set(d) - {"optimizer", "lr_scheduler", "monitor"}
    if extra:  # Lightning 2.x's warning: "frequency" and the like are not supported any more
        warnings.warn(f"Found unsupported keys in the optimizer configuration: {extra}", RuntimeWarning, stacklevel=4)
    if not _is_optimizer(d.get("optimizer")):
        raise ConfigError(f"configure_optimizers(): optimizer={type(d.get('optimizer')).__name__} in {sorted(d)}; "
                          "valid: a torch.optim.Optimizer under 'optimizer'")


def split_config(conf: Any) -> tuple[list, list, str | None]:
    """(optimizers, schedulers as given, monitor) of any accepted form; ConfigError otherwise."""
    seq = isinstance(conf, (list, tuple))
    if _is_optimizer(conf):
        return [conf], [], None
    if seq and len(conf) == 2 and isinstance(conf[0], list) and all(_is_optimizer(o) for o in conf[0]):
        return list(conf[0]), list(conf[1]) if isinstance(conf[1], list) else [conf[1]], None
    if isinstance(conf, dict):
        _check_dict(conf)
        return [conf["optimizer"]], [conf["lr_scheduler"]] if "lr_scheduler" in conf else [], conf.get("monitor")
    if seq and conf and all(isinstance(d, dict) for d in conf):
        for d in conf:
            _check_dict(d)
        schedulers = [dict(s) if isinstance(s, dict) else {"scheduler": s}
                      for s in (d["lr_scheduler"] for d in conf if "lr_scheduler" in d)]
        return [d["optimizer"] for d in conf], schedulers, None
    if seq and conf and all(_is_optimizer(o) for o in conf):
        return list(conf), [], None
    if seq and len(conf) == 2 and _is_optimizer(conf[0]):  # zerotrain's (optimizer, scheduler)
        return [conf[0]], [] if conf[1] is None else [{"scheduler": conf[1], "interval": "step"}], None
    raise ConfigError(_UNKNOWN)


def automatic_configs(schedulers: list, monitor: str | None) -> list[LRSchedulerConfig]:
    """Each scheduler (or scheduler dict) as a config, automatic optimization: Lightning's defaults,
    warnings (unknown keys; a OneCycleLR stepped per epoch) and refusals (no ``scheduler``, a bad
    ``interval``, a plateau scheduler without a monitor)."""
    configs = []
    known = {f.name for f in dataclasses.fields(LRSchedulerConfig)}
    for entry in schedulers:
        if not isinstance(entry, dict):
            if isinstance(entry, _PLATEAU) and monitor is None:
                raise ConfigError("`configure_optimizers` must include a monitor when a `ReduceLROnPlateau` "
                                  'scheduler is used. For example: {"optimizer": optimizer, "lr_scheduler": '
                                  'scheduler, "monitor": "metric_to_track"}')
            plateau = isinstance(entry, _PLATEAU)
            configs.append(LRSchedulerConfig(entry, reduce_on_plateau=plateau, monitor=monitor if plateau else None))
            continue
        extra = set(entry) - known
        if extra:
            warnings.warn(f"Found unsupported keys in the lr scheduler dict: {extra}. HINT: remove them from the "
                          "output of `configure_optimizers`.", RuntimeWarning, stacklevel=3)
            entry = {k: v for k, v in entry.items() if k in known}
        if "scheduler" not in entry:
            raise ConfigError('The lr scheduler dict must have the key "scheduler" with its item being an lr scheduler')
        if entry.get("interval", "epoch") not in ("step", "epoch"):
            raise ConfigError(f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is '
                              f'"{entry["interval"]}"')
        frequency = entry.get("frequency", 1)
        if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
            raise ConfigError(f"lr_scheduler frequency={frequency!r}; valid: an integer >= 1")
        entry = {"reduce_on_plateau": isinstance(entry["scheduler"], _PLATEAU), **entry}
        if entry["reduce_on_plateau"] and entry.get("monitor") is None:
            raise ConfigError("The lr scheduler dict must include a monitor when a `ReduceLROnPlateau` scheduler is "
                              'used. For example: {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, '
                              '"monitor": "your_loss"}}')
        one_cycle = isinstance(entry["scheduler"], torch.optim.lr_scheduler.OneCycleLR)
        if one_cycle and entry.get("interval", "epoch") == "epoch":
            warnings.warn("A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't mean "
                          "'interval': 'step'?", RuntimeWarning, stacklevel=3)
        configs.append(LRSchedulerConfig(**entry))
    return configs


def manual_configs(schedulers: list) -> list[LRSchedulerConfig]:
    """Each scheduler as a config, manual optimization (the user steps them): the keys that only
    matter to the Trainer's stepping (``reduce_on_plateau``, ``monitor``, ``strict``) are ignored
    with Lightning's warning."""
    configs = []
    for entry in schedulers:
        if not isinstance(entry, dict):
            configs.append(LRSchedulerConfig(entry))
            continue
        ignored = [k for k in entry if k in ("reduce_on_plateau", "monitor", "strict")]
        if ignored:
            warnings.warn(f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. You "
                          "need to call `lr_scheduler.step()` manually in manual optimization.", RuntimeWarning,
                          stacklevel=3)
        configs.append(LRSchedulerConfig(**{k: v for k, v in entry.items() if k not in ignored}))
    return configs


def _names_optimizer_idx(module: Any) -> bool:
    """``training_step`` has a parameter of its own named ``optimizer_idx`` (not ``*args``)."""
    import inspect

    try:
        params = inspect.signature(module.training_step).parameters
    except (TypeError, ValueError):
        return False
    return "optimizer_idx" in params


def check_configs(optimizers: list, configs: list[LRSchedulerConfig], module: Any) -> None:
    """Lightning's refusals: several optimizers under automatic optimization; a scheduler of an
    optimizer not returned; a scheduler without ``state_dict``/``load_state_dict``, or outside
    torch's scheduler API when the module does not override ``lr_scheduler_step``."""
    from ..utilities import is_overridden

    automatic = getattr(module, "automatic_optimization", True)
    if _names_optimizer_idx(module):  # Lightning 1.x's automatic multi-optimizer signature, removed in 2.0
        raise MultipleOptimizersError(OPTIMIZER_IDX)
    if automatic and len(optimizers) > 1:
        raise MultipleOptimizersError(MULTIPLE_AUTOMATIC)
    for c in configs:
        if not any(getattr(c.scheduler, "optimizer", None) is o for o in optimizers):
            raise ConfigError("Some schedulers are attached with an optimizer that wasn't returned from "
                              "`configure_optimizers`.")
        name = type(c.scheduler).__name__
        if not all(callable(getattr(c.scheduler, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"The provided lr scheduler `{name}` is invalid. It should have `state_dict` and "
                            "`load_state_dict` methods defined.")
        torch_api = isinstance(c.scheduler, (torch.optim.lr_scheduler.LRScheduler, _PLATEAU))
        if automatic and not torch_api and not is_overridden("lr_scheduler_step", module):
            raise ConfigError(f"The provided lr scheduler `{name}` doesn't follow PyTorch's LRScheduler API. You "
                              "should override the `LightningModule.lr_scheduler_step` hook with your own logic if you "
                              "are using a custom LR scheduler.")


def parse_optimizers(conf: Any, automatic: bool = True) -> tuple[list, list[LRSchedulerConfig]]:
    """(optimizers, scheduler configs) of ``configure_optimizers()``'s output."""
    optimizers, schedulers, monitor = split_config(conf)
    return optimizers, automatic_configs(schedulers, monitor) if automatic else manual_configs(schedulers)


def init_optimizers(module: Any) -> tuple[list, list[LRSchedulerConfig]]:
    """``module.configure_optimizers()`` called, read and checked (None: a warning and an optimizer
    that changes nothing, see ``optimization._or_no_op``)."""
    from .optimization import _or_no_op

    optimizers, configs = parse_optimizers(_or_no_op(module.configure_optimizers(), module),
                                           getattr(module, "automatic_optimization", True))
    check_configs(optimizers, configs, module)
    return optimizers, configs


# Lightning's names (lightning.pytorch.core.optimizer)
_configure_optimizers = split_config
_configure_schedulers_automatic_opt = automatic_configs
_configure_schedulers_manual_opt = manual_configs
_init_optimizers_and_lr_schedulers = init_optimizers
