"""The one place that calls callback hooks, in the order the callbacks were given."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from ..callbacks.base import Callback


HOOKS = (
    "setup", "on_fit_start", "on_fit_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_validation_epoch_start", "on_validation_epoch_end",
    "on_test_epoch_start", "on_test_epoch_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_save_checkpoint", "on_load_checkpoint", "on_exception", "teardown",
)


class HookDispatcher:
    def __init__(self, callbacks: Sequence["Callback"]) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, hook: str, trainer: Any, module: Any, *args: Any) -> None:
        if hook not in HOOKS:
            raise ValueError(f"unknown hook {hook!r}")
        for cb in self.callbacks:
            getattr(cb, hook)(trainer, module, *args)

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in self.callbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])
