"""The module every strategy runs its forward through: ``StepWrapper`` turns ``forward(method,
*args)`` into a call of the user's step method, so that wrappers acting on ``forward`` (DDP's
gradient hooks, ZeRO-3's gather hooks) see the training step. Which of the arguments a step
method accepts is the caller's rule, handed in as ``step_call`` (the Trainer hands Lightning's,
``trainer/loop/signature.py``); this package never imports the Trainer."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

#: ``(step method, its name, args, kwargs) -> (args, kwargs)``: what the method accepts of them
StepCall = Callable[[Callable[..., Any], str, tuple, dict], tuple[tuple, dict]]


class StepWrapper(nn.Module):
    """Routes ``forward`` to the TrainModule's step methods, so that wrappers which act on
    ``forward`` (DDP's gradient hooks, ZeRO-3's gather hooks) see the user's training step."""

    def __init__(self, module: nn.Module, step_call: StepCall | None = None) -> None:
        super().__init__()
        self.module, self.step_call = module, step_call

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.module, method)
        if self.step_call is not None:  # the Trainer's: the arguments this method accepts
            args, kwargs = self.step_call(fn, method, args, kwargs)
        return fn(*args, **kwargs)
