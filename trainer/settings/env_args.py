"""``Trainer`` arguments from the environment, as Lightning reads them: ``PL_TRAINER_<ARGUMENT>``
(``PL_TRAINER_MAX_STEPS=7``, ``PL_TRAINER_LOGGER=False``) gives the default of that argument; an
argument passed to the constructor wins. A value is read as a Python literal (``7``, ``False``,
``0.5``, ``[0, 1]``) and kept as text when it is not one (``PL_TRAINER_STRATEGY=ddp``); an empty
variable counts as unset. The prefix is the class's name in capitals, so a subclass
``MyTrainer`` reads ``PL_MYTRAINER_*``."""
from __future__ import annotations

import ast
import functools
import inspect
import os
from typing import Any, Callable


def from_environment(cls: type) -> dict[str, Any]:
    """The ``PL_<CLASS>_<ARGUMENT>`` variables set for ``cls``'s constructor arguments."""
    found: dict[str, Any] = {}
    for name in inspect.signature(cls).parameters:
        text = os.environ.get(f"PL_{cls.__name__.upper()}_{name.upper()}")
        if text:
            try:
                found[name] = ast.literal_eval(text)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                found[name] = text
    return found


def environment_defaults(init: Callable[..., None]) -> Callable[..., None]:
    """Decorates ``__init__``: the environment's values fill the arguments not passed."""

    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        return init(self, *args, **{**from_environment(type(self)), **kwargs})

    return wrapped
