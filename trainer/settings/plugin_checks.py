"""``Trainer(callbacks=, logger=)`` checked when the Trainer is built: ``callbacks=[1]`` or
``logger='x'`` is a TypeError naming the argument, the value and what is expected, instead of an
AttributeError at the first hook or log call, after set-up (pytorch_lightning 2.6 takes both
without a word). Lightning's duck typing stays: a callback that is not our :class:`Callback` but
has Lightning's hook methods or a ``state_key`` (a ``pytorch_lightning.Callback``, or any object
with an ``on_train_end``), and a logger with the methods the Trainer calls, are welcome."""
from __future__ import annotations

from typing import Any

from ...callbacks.base import Callback, Logger
from ..errors import ConfigError

#: the methods that make an object a callback: Lightning's hook names (every hook ours define)
CALLBACK_METHODS = tuple(sorted(n for n, v in vars(Callback).items()
                                if callable(v) and (n.startswith("on_") or n in ("setup", "teardown"))))

_CALLBACK = ("a Callback: an instance of zerotrain's or pytorch_lightning's Callback, or an object with "
             "Lightning's hook methods (on_train_start, ..., setup, teardown) or a state_key")
#: what the Trainer calls on a logger (besides the optional ``log_dir`` and ``log_graph``)
LOGGER_METHODS = ("log_metrics", "log_hyperparams", "save", "finalize")
_LOGGER = ("True, False, None, a Logger (zerotrain's or pytorch_lightning's, or an object with "
           f"{', '.join(LOGGER_METHODS)} methods) or a list of them")


def is_callback(obj: Any) -> bool:
    if isinstance(obj, Callback):
        return True
    if isinstance(obj, type):  # a class where an instance was meant: Trainer(callbacks=[ModelCheckpoint])
        return False
    return hasattr(obj, "state_key") or any(callable(getattr(obj, n, None)) for n in CALLBACK_METHODS)


def is_logger(obj: Any) -> bool:
    return isinstance(obj, Logger) or (not isinstance(obj, type)
                                       and all(callable(getattr(obj, n, None)) for n in LOGGER_METHODS))


def check_callbacks(callbacks: Any) -> list:
    """``Trainer(callbacks=)`` as a list: None, one callback, or a list/tuple of them. Raises
    TypeError naming the argument (and the item), the value and what is expected."""
    if callbacks is None:
        return []
    if is_callback(callbacks):
        return [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"Trainer: callbacks={callbacks!r}; expected None, {_CALLBACK}, or a list of them")
    for i, cb in enumerate(callbacks):
        if not is_callback(cb):
            what = f"the class {cb.__name__}, not an instance of it" if isinstance(cb, type) else \
                f"a {type(cb).__name__}"
            raise TypeError(f"Trainer: callbacks[{i}]={cb!r} is {what}; expected {_CALLBACK}")
    return list(callbacks)


def check_logger(logger: Any) -> None:
    """``Trainer(logger=)``: True, False, None, a logger or a list/tuple of loggers. Raises
    TypeError naming the argument (and the item), the value and what is expected."""
    if logger is None or isinstance(logger, bool):
        return
    if isinstance(logger, (list, tuple)):
        for i, lg in enumerate(logger):
            if not is_logger(lg):
                raise TypeError(f"Trainer: logger[{i}]={lg!r} is not a logger; expected {_LOGGER}")
    elif not is_logger(logger):
        raise TypeError(f"Trainer: logger={logger!r} is not a logger; expected {_LOGGER}")


def check_plugins(plugins: Any) -> None:
    """``Trainer(plugins=)``: Lightning's argument, taken when it asks for nothing (None or an empty
    list); a plugin object is refused with what zerotrain does instead, since the Trainer would
    not use it: precision is ``Trainer(precision=...)``, the cluster is detected (torchrun, SLURM,
    our launcher), and checkpoints are written by zerotrain's own writer."""
    if plugins is None or (isinstance(plugins, (list, tuple)) and not plugins):
        return
    raise ConfigError(f"Trainer: plugins={plugins!r}: zerotrain takes no plugin objects; valid: None or []. "
                      "Instead: precision via Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed'), the cluster "
                      "environment is detected (torchrun, SLURM, zerotrain's launcher), checkpoint IO is zerotrain's own")
