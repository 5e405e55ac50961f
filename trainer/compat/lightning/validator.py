"""Lightning's checks of a module before a run (``lightning.pytorch.trainer.configuration_validator``):
a fit needs ``training_step`` and ``configure_optimizers``; ``validate``/``test`` need their step;
``predict`` a ``predict_step`` (not None) or a ``forward``; the epoch-end hooks Lightning 2.0
removed are refused. Lightning's messages."""
from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from ...utilities import PossibleUserWarning, is_overridden, rank_zero_warn

_MINIMUM = ("Lightning `Trainer` expects as minimum a `training_step()`, `train_dataloader()` and "
            "`configure_optimizers()` to be defined.")


def _refuse_removed(model: Any, hook: str, instead: str) -> None:
    """NotImplementedError when ``model`` still defines ``hook`` (removed in Lightning 2.0)."""
    if callable(getattr(model, hook, None)):
        raise NotImplementedError(
            f"Support for `{hook}` has been removed in v2.0.0. `{type(model).__name__}` implements this method. You "
            f"can use the `{instead}` hook instead. To access outputs, save them in-memory as instance attributes. "
            "You can find migration examples in https://github.com/Lightning-AI/pytorch-lightning/pull/16520.")


def verify_fit(model: Any, has_val_loader: bool | None = None) -> None:
    """A fit's requirements; with ``has_val_loader`` known, the warnings for a validation loader
    without a step and a step without a loader."""
    for hook in ("training_step", "configure_optimizers"):
        if not is_overridden(hook, model):
            raise ConfigError(f"No `{hook}()` method defined. {_MINIMUM}")
    has_val_step = is_overridden("validation_step", model)
    if has_val_loader and not has_val_step:
        rank_zero_warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop.")
    if has_val_step and has_val_loader is False:
        rank_zero_warn("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop.",
                       category=PossibleUserWarning)
    _refuse_removed(model, "training_epoch_end", "on_train_epoch_end")
    _refuse_removed(model, "validation_epoch_end", "on_validation_epoch_end")


def verify_eval(model: Any, stage: str) -> None:
    """``stage`` ("val", "test" or "predict")'s requirements."""
    step = "validation_step" if stage == "val" else f"{stage}_step"
    if stage == "predict":
        if model.predict_step is None:
            raise ConfigError("`predict_step` cannot be None to run `Trainer.predict`")
        if not is_overridden(step, model) and not is_overridden("forward", model):
            raise ConfigError("`Trainer.predict` requires `forward` method to run.")
        return
    if not is_overridden(step, model):
        raise ConfigError(f"No `{step}()` method defined to run `Trainer.{'validate' if stage == 'val' else stage}`.")
    hook = "validation_epoch_end" if stage == "val" else "test_epoch_end"
    _refuse_removed(model, hook, f"on_{hook}")


def __verify_train_val_loop_configuration(trainer: Any, model: Any) -> None:
    """Lightning's name for ``verify_fit`` (``trainer`` unused: the loaders are not known here)."""
    verify_fit(model)


def __verify_eval_loop_configuration(model: Any, stage: str) -> None:
    """Lightning's name for ``verify_eval``."""
    verify_eval(model, stage)


def verify_stage(trainer: Any, model: Any, stage: str, datamodule: Any = None, val_loaders: Any = None) -> None:
    """What the Trainer checks before a stage's set-up, as Lightning's ``_verify_loop_configurations``:
    a fit's requirements (with whether a validation loader is defined: passed to ``fit``, or a
    datamodule's or the module's ``val_dataloader``), or an evaluation's step. A strategy that runs
    its own schedule (the pipeline) has no step methods of the module to check."""
    from ...api.datamodule import overrides_hook
    from ...api.module import TrainModule

    if not isinstance(model, TrainModule):  # refused by the set-up
        return
    if stage == "fit" and not model.automatic_optimization:  # before any set-up, as Lightning
        from ...optim.optimization import Optimization

        Optimization._check_manual(trainer)
    if trainer.strategy.runs_own_schedule:
        return
    if stage == "fit":
        dm = datamodule if datamodule is not None else trainer.datamodule
        verify_fit(model, val_loaders is not None or overrides_hook(dm, "val_dataloader")
                   or overrides_hook(model, "val_dataloader"))
    else:
        verify_eval(model, {"validate": "val", "test": "test", "predict": "predict"}[stage])
