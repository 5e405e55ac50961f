"""What a user's step method or hook accepts, read from its signature as Lightning reads it, so
that a Lightning module runs unchanged: ``training_step(self, batch)`` gets no ``batch_idx``,
``validation_step(self, batch, batch_idx, dataloader_idx=0)`` gets the loader index when there
are several loaders, and a step set to None (``validation_step = None``) is switched off."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

#: the step methods whose optional arguments are inspected (Lightning inspects these only)
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@functools.lru_cache(maxsize=256)
def _parameters(fn: Callable) -> tuple[tuple[str, ...], bool]:
    """(names of the positional parameters, whether it takes ``*args``)."""
    fn = getattr(fn, "__wrapped__", fn)  # a decorated step: the function underneath, as Lightning
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: assume it takes everything
        return (), True
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names, any(p.kind is p.VAR_POSITIONAL for p in params)


def takes(fn: Callable, name: str, min_args: int | None = None) -> bool:
    """Lightning's rule: ``fn`` accepts ``name`` when it names it, takes ``*args``, or has at
    least ``min_args`` positional parameters (``self`` not counted)."""
    func = getattr(fn, "__func__", None)
    names, varargs = _parameters(func if func is not None else fn)
    if func is not None and names:  # a bound method: its self is not an argument
        names = names[1:]
    return name in names or varargs or (min_args is not None and len(names) >= min_args)


def step_args(fn: Callable, args: tuple) -> tuple:
    """The arguments ``(batch, batch_idx[, dataloader_idx])`` that a step method ``fn`` takes:
    ``batch_idx`` is dropped when its signature has room for the batch only (Lightning's
    ``min_args=2`` check). ``dataloader_idx`` is passed only when given (several loaders)."""
    if len(args) >= 2 and not takes(fn, "batch_idx", min_args=2):
        return (args[0],) + tuple(args[2:])
    return args


def step_call(fn: Callable, method: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The strategies' ``StepWrapper`` calls a step method with these arguments (the Trainer hands
    it this as ``Strategy.step_call``): a step method's keywords (``dataloader_idx``) go after its
    positional arguments, less those it has no room for; any other method is called unchanged."""
    if method in STEP_METHODS:
        return step_args(fn, args + tuple(kwargs.values())), {}
    return args, kwargs


def required_without_default(fn: Callable, name: str) -> bool:
    """``fn`` names ``name`` with no default value (Lightning refuses that for ``dataloader_idx``
    with a single loader)."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is inspect.Parameter.empty


def overridden(obj: Any, name: str, base: type) -> bool:
    """``obj`` has its own ``name``: not ``base``'s no-op, and not set to None (Lightning's way of
    switching a step off, e.g. ``validation_step = None``)."""
    own = getattr(obj, name, None)
    if own is None:
        return False
    return getattr(type(obj), name, None) is not getattr(base, name, None) or name in vars(obj)
