"""The one place that calls hooks: the callbacks', in the order the callbacks were given, then
the module's - Lightning's order for every hook the two share. The dispatcher also marks the
loop's phases (``HookDispatcher.mark``: the progress watchdog's ticks, the ResourceMonitor's
step-time parts): each loop hook marks its own, once and then per callback, so the loop's call
sites never repeat a hook's name."""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

if TYPE_CHECKING:
    from ...callbacks.base import Callback
    from ..api.module import TrainModule

from ..logs.connector import hook_scope

log = logging.getLogger(__name__)

_STAGE_HOOKS = tuple(f"on_{s}_{when}" for s in ("validation", "test", "predict")
                     for when in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end"))

#: hooks called on callbacks as ``hook(trainer, module, *args)``
HOOKS = (
    "setup", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward",
    "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", *_STAGE_HOOKS,
    "on_save_checkpoint", "on_load_checkpoint", "on_exception", "teardown",
    "on_sanity_check_start", "on_sanity_check_end",
)

#: hooks called on the module as ``hook(*args)`` (after the callbacks' where both have one)
MODULE_HOOKS = tuple(h for h in HOOKS if h != "on_exception" and "sanity" not in h) + ("configure_callbacks",)


#: the hooks every rank calls at the same places of the loop, so that a watchdog tick per callback
#: keeps every rank's count equal (not, e.g., ``on_save_checkpoint``, which runs where a file is written)
LOOP_HOOKS = frozenset({"on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end",
                        "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
                        "on_validation_epoch_end", "on_before_backward", "on_after_backward",
                        "on_before_optimizer_step", "on_before_zero_grad"})


class HookDispatcher:
    """Calls the hooks; ``mark(phase)`` (the Trainer's phase marker, None: no marks) is told each
    loop phase: a loop hook's name before it runs, and once per callback (``LOOP_HOOKS``)."""

    def __init__(self, callbacks: Sequence["Callback"], mark: Callable[[str], None] | None = None) -> None:
        self.callbacks = list(callbacks)
        self._mark = mark
        self._legacy_warned: set[str] = set()

    def mark(self, phase: str) -> None:
        """A phase of the loop that is no hook (``training_step``, ``backward``, ``optimizer_step``...)."""
        if self._mark is not None:
            self._mark(phase)

    def __call__(self, hook: str, trainer: Any, module: Any, *args: Any, only: Any = None) -> None:
        """The callbacks' ``hook`` only (a callback-only hook, or one the module gets elsewhere);
        ``only(cb)`` picks which callbacks (None: all)."""
        if hook not in HOOKS:
            raise ValueError(f"unknown hook {hook!r}")
        for cb in self.callbacks:
            if only is not None and not only(cb):
                continue
            fn = getattr(cb, hook, None)  # a duck-typed callback may define only the hooks it uses
            if fn is None:
                continue
            if hook in LOOP_HOOKS:  # one watchdog tick per callback: a rank stuck
                self.mark(f"{hook} ({type(cb).__name__})")  # in one callback (a rank-0-only forward) is behind
                # one whose peer waits in the next callback's collective (a checkpoint save)
            with hook_scope(trainer, hook), _profiled(trainer, f"[Callback]{_state_key(cb)}.{hook}"):
                # a callback's pl_module.log logs under the hook's name
                if hook in ("setup", "teardown") and not _takes_stage(fn):
                    self._warn_legacy(cb, hook)
                    fn(trainer, module)
                elif hook in ("setup", "teardown"):  # the stage by keyword, as Lightning
                    fn(trainer, module, stage=args[0])
                else:
                    fn(trainer, module, *args)

    def both(self, hook: str, trainer: Any, module: Any, *args: Any) -> Any:
        """Lightning's order: every callback's ``hook``, then the module's; returns the module's
        result (``on_train_batch_start`` returning -1 ends the epoch). As Lightning, the monitoring
        callbacks (``EarlyStopping``, ``ModelCheckpoint``) get ``on_train_epoch_end`` after the
        module, so they see what the module's ``on_train_epoch_end`` logged."""
        if hook in LOOP_HOOKS:
            self.mark(hook)
        last = _monitoring if hook == "on_train_epoch_end" else None
        self(hook, trainer, module, *args, only=None if last is None else (lambda cb: not last(cb)))
        with hook_scope(trainer, hook), _profiled(trainer, f"[LightningModule]{type(module).__name__}.{hook}"):
            if hook in ("setup", "teardown"):  # the stage by keyword, as Lightning
                result = getattr(module, hook)(stage=args[0])
            else:
                result = getattr(module, hook)(*args)
        if last is not None:
            self(hook, trainer, module, *args, only=last)
        return result

    def module_hook(self, hook: str, trainer: Any, module: Any, *args: Any) -> Any:
        """A module-only hook (no callback has it: ``on_validation_model_eval``, ...), profiled."""
        with hook_scope(trainer, hook), _profiled(trainer, f"[LightningModule]{type(module).__name__}.{hook}"):
            return getattr(module, hook)(*args)

    def _warn_legacy(self, cb: "Callback", hook: str) -> None:
        """A callback written before ``setup``/``teardown`` took ``stage``: still called, without
        it; said once per callback type and hook."""
        key = f"{type(cb).__name__}.{hook}"
        if key not in self._legacy_warned:
            self._legacy_warned.add(key)
            log.warning("%s(trainer, module) takes no stage: called without it; valid: %s(trainer, module, "
                        "stage) as Lightning's", key, hook)

    def state_dict(self) -> dict[str, Any]:
        return {_state_key(cb): cb.state_dict() for cb in self.callbacks if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each callback's saved state; a saved state no callback here takes is Lightning's warning."""
        missing = [k for k, v in state.items() if v and k not in {_state_key(cb) for cb in self.callbacks}]
        if missing:
            import warnings

            warnings.warn("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be "
                          "provided during `Trainer` instantiation. Please add the following callbacks: "
                          f"{missing}.", UserWarning, stacklevel=3)
        for cb in self.callbacks:
            if _state_key(cb) in state and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state[_state_key(cb)])


def _monitoring(cb: Any) -> bool:
    """Lightning's 'monitoring callbacks': early stopping and checkpointing."""
    from ...callbacks.checkpoint import ModelCheckpoint
    from ...callbacks.early_stopping import EarlyStopping

    return isinstance(cb, (EarlyStopping, ModelCheckpoint))


def _state_key(cb: Any) -> str:
    """A callback's key in a checkpoint: its ``state_key``, or its class's qualified name (as
    Lightning's default) for a duck-typed one without it."""
    return getattr(cb, "state_key", None) or type(cb).__qualname__


def datamodule_hook(trainer: Any, datamodule: Any, hook: str, *args: Any) -> Any:
    """The datamodule's ``hook``, timed by the Trainer's profiler as ``[DataModule]<class>.<hook>``
    (Lightning's ``[LightningDataModule]``, by the README's rename)."""
    with _profiled(trainer, f"[DataModule]{type(datamodule).__name__}.{hook}"):
        if hook in ("setup", "teardown"):  # the stage by keyword, as Lightning
            return getattr(datamodule, hook)(stage=args[0])
        return getattr(datamodule, hook)(*args)


def _profiled(trainer: Any, action: str) -> Any:
    """The Trainer's profiler timing ``action`` (Lightning's names for hooks), if it has one."""
    profiler = getattr(trainer, "profiler", None)
    return profiler.profile(action) if profiler is not None else contextlib.nullcontext()


def _takes_stage(fn: Any) -> bool:
    """Whether a bound ``setup``/``teardown`` accepts a third argument (``stage``)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "stage" for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def merge_callbacks(callbacks: list, extra: Any) -> list:
    """Lightning's ``configure_callbacks``: the module's callbacks are added; a Trainer callback
    whose type the module's callback is (a subclass of) is replaced, and checkpoint callbacks go
    last, so they save what the others have updated."""
    from ...callbacks.base import Callback
    from ...callbacks.checkpoint import ModelCheckpoint

    extra = list(extra) if isinstance(extra, (list, tuple)) else ([extra] if extra is not None else [])
    if not extra:
        return callbacks
    replaced = {type(cb) for cb in callbacks if type(cb) is not Callback
                and any(isinstance(new, type(cb)) for new in extra)}
    if replaced:
        log.info("the module's configure_callbacks replaces the Trainer's %s",
                 ", ".join(sorted(t.__name__ for t in replaced)))
    merged = [cb for cb in callbacks if type(cb) not in replaced] + extra
    return ([cb for cb in merged if not isinstance(cb, ModelCheckpoint)]
            + [cb for cb in merged if isinstance(cb, ModelCheckpoint)])


def hook_owners(callbacks: list, module: "TrainModule | None") -> list[tuple[Any, type]]:
    """Each object whose hooks the Trainer calls, with the base class whose no-ops it overrides."""
    from ...callbacks.base import Callback
    from ..api.module import TrainModule

    return [(cb, Callback) for cb in callbacks] + ([(module, TrainModule)] if module is not None else [])


def warn_skipped_hooks(strategy: Any, callbacks: list, module: "TrainModule", is_global_zero: bool) -> None:
    """A strategy that runs its own schedule never calls some hooks (``Strategy.skipped_hooks``):
    say once (global rank 0, first fit) which callbacks override one, so nothing is silently off."""
    skipped = set(strategy.skipped_hooks)
    found = [f"{type(obj).__name__}.{hook}" for obj, base in hook_owners(callbacks, module)
             for hook in sorted(skipped) if getattr(type(obj), hook, None) is not getattr(base, hook, None)]
    if found and is_global_zero:
        log.warning("strategy=%r: runs its own forward/backward schedule and never calls %s; these "
                    "overrides will not run: %s", strategy, ", ".join(sorted(skipped)), ", ".join(found))


def batch_end_outputs(out: Any, manual: bool, accumulation: int) -> dict[str, Any]:
    """What ``on_train_batch_end`` gets as ``outputs``, as Lightning builds it from the training
    step's return: a dict with the loss detached (automatic optimization: divided by
    ``accumulate_grad_batches``, as the loss that is backwarded) and the step's other keys; ``{}``
    when the step returned None."""
    if out is None:
        return {}
    extra = dict(out) if isinstance(out, Mapping) else {"loss": out}
    loss = extra.get("loss")
    if torch.is_tensor(loss):
        extra["loss"] = loss.detach() if manual else (loss / accumulation).detach()  # the division is a new tensor
    return extra

