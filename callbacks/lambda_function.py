"""``LambdaCallback``: a callback made of functions, one per hook (Lightning's)."""
from __future__ import annotations

from typing import Any, Callable

from ..trainer.loop.hooks import HOOKS
from .base import Callback

#: the hooks a LambdaCallback takes (Lightning's list: the callback hooks and the sanity check's)
LAMBDA_HOOKS = tuple(dict.fromkeys((*HOOKS, "on_sanity_check_start", "on_sanity_check_end",
                                    "on_predict_epoch_start", "on_predict_epoch_end")))


class LambdaCallback(Callback):
    """``LambdaCallback(on_train_epoch_end=fn, ...)``: each function given is called as that hook
    (``fn(trainer, module, ...)``); a hook not given does nothing. An unknown hook name is an error."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        unknown = sorted(set(hooks) - set(LAMBDA_HOOKS))
        if unknown:
            raise TypeError(f"LambdaCallback: unknown hook(s) {unknown}; valid: {', '.join(LAMBDA_HOOKS)}")
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
