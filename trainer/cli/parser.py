"""The argument parser of ``zerotrain.cli.LightningCLI``: a jsonargparse ``ArgumentParser`` that
reads the signatures of the Trainer, TrainModule, DataModule, callbacks, optimizers and learning
rate schedulers (Lightning's ``LightningArgumentParser``), and the optimizer / scheduler types a
CLI script annotates its arguments with."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Union

import torch
from jsonargparse import ArgumentParser, Namespace, class_from_function, register_unresolvable_import_paths
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ...callbacks.base import Callback
from ..api.datamodule import DataModule
from ..errors import MisconfigurationException
from ..api.module import TrainModule
from ..loop.trainer import Trainer

# torch's objects whose __module__ does not import them (torch.nn.Softmax ... say torch._C): as
# Lightning, jsonargparse is told where they are, so that a config holding them dumps and reloads
register_unresolvable_import_paths(torch)

#: jsonargparse with signatures is a requirement of ``zerotrain.cli`` (Lightning's flag name)
_JSONARGPARSE_SIGNATURES_AVAILABLE = True


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau plus the metric it follows (``monitor``), so that the CLI can
    hand it to the Trainer as ``{"scheduler": ..., "monitor": ...}``."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


#: the scheduler classes the CLI accepts (torch's ReduceLROnPlateau only through ours: it needs ``monitor``)
LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
LRSchedulerType = Union[type[LRScheduler], type[ReduceLROnPlateau]]
#: what ``LightningCLI(args=...)`` takes: command-line strings, or a parsed structure
ArgsType = Union[list[str], dict[str, Any], Namespace, None]
#: annotations for a module's constructor: an optimizer / scheduler built later from its parameters
OptimizerCallable = Callable[[Iterable], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], Union[LRScheduler, ReduceLROnPlateau]]

_CONFIGURABLE = (Trainer, TrainModule, DataModule, Callback)


def _as_tuple(classes: Any) -> tuple[type, ...]:
    return classes if isinstance(classes, tuple) else (classes,)


class LightningArgumentParser(ArgumentParser):
    """jsonargparse's parser with Lightning's defaults (environment prefix ``PL``, off unless
    ``default_env=True``) and the ``add_*_args`` helpers of the CLI."""

    def __init__(self, *args: Any, description: str = "zerotrain Trainer command line tool", env_prefix: str = "PL",
                 default_env: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        #: nested keys of the callbacks added with ``add_lightning_class_args``: the CLI gives them to the Trainer
        self.callback_keys: list[str] = []
        #: nested key -> (class or tuple of classes, link_to), for the optimizers / schedulers added
        self._optimizers: dict[str, tuple[Any, str]] = {}
        self._lr_schedulers: dict[str, tuple[Any, str]] = {}

    def add_lightning_class_args(self, lightning_class: Any, nested_key: str, subclass_mode: bool = False,
                                 required: bool = True) -> list[str]:
        """The constructor arguments of ``lightning_class`` (a Trainer, TrainModule, DataModule or
        Callback class, or a function returning one) under ``nested_key``; ``subclass_mode``: any
        subclass, chosen with ``class_path``. Returns the keys added."""
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not (isinstance(lightning_class, type) and issubclass(lightning_class, _CONFIGURABLE)):
            raise MisconfigurationException(
                f"Cannot add arguments from: {lightning_class}. You should provide either a callable or a subclass of: "
                "Trainer, TrainModule (LightningModule), DataModule (LightningDataModule), or Callback.")
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        # the Trainer stays a group of arguments: the CLI builds it itself, with the callbacks added
        return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, sub_configs=True,
                                        instantiate=not issubclass(lightning_class, Trainer))

    def add_optimizer_args(self, optimizer_class: Any = (Optimizer,), nested_key: str = "optimizer",
                           link_to: str = "AUTOMATIC") -> None:
        """An optimizer's arguments (its ``params`` left out) under ``nested_key``: one class, or a
        tuple of base classes to choose from. ``link_to``: a key to hand the config to, or
        ``"AUTOMATIC"`` (the CLI then writes the module's ``configure_optimizers``)."""
        if not all(isinstance(c, type) and issubclass(c, Optimizer) for c in _as_tuple(optimizer_class)):
            raise MisconfigurationException(f"add_optimizer_args: {optimizer_class!r}; valid: a subclass of "
                                            "torch.optim.Optimizer, or a tuple of them")
        self._add_unbuilt(optimizer_class, nested_key, skip={"params"})
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(self, lr_scheduler_class: Any = LRSchedulerTypeTuple, nested_key: str = "lr_scheduler",
                              link_to: str = "AUTOMATIC") -> None:
        """A learning rate scheduler's arguments (its ``optimizer`` left out), as ``add_optimizer_args``."""
        if not all(isinstance(c, type) and issubclass(c, LRSchedulerTypeTuple) for c in _as_tuple(lr_scheduler_class)):
            raise MisconfigurationException(f"add_lr_scheduler_args: {lr_scheduler_class!r}; valid: a subclass of "
                                            "torch.optim.lr_scheduler.LRScheduler or zerotrain.cli.ReduceLROnPlateau, "
                                            "or a tuple of them")
        self._add_unbuilt(lr_scheduler_class, nested_key, skip={"optimizer"})
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def _add_unbuilt(self, classes: Any, nested_key: str, skip: set[str]) -> None:
        """Arguments of a class the CLI builds later itself (it needs the parameters / optimizer)."""
        if isinstance(classes, tuple):
            self.add_subclass_arguments(classes, nested_key, instantiate=False, fail_untyped=False, skip=skip)
        else:
            self.add_class_arguments(classes, nested_key, sub_configs=True, instantiate=False, fail_untyped=False,
                                     skip=skip)


def keep_none() -> dict[str, bool]:
    """``dump`` / ``save`` keywords that keep the None values in the output (a config file that
    reproduces the run): ``skip_unset=False`` (jsonargparse >= 4.49), ``skip_none=False`` before."""
    import jsonargparse

    version = tuple(int(part) for part in jsonargparse.__version__.split(".")[:2] if part.isdigit())
    return {"skip_unset": False} if version >= (4, 49) else {"skip_none": False}


def class_path_of(cls: type) -> str:
    """Where ``cls`` is defined, as a dot path."""
    return f"{cls.__module__}.{cls.__name__}"


def with_class_path(cls: type, init_args: Any = None) -> dict[str, Any]:
    """``{"class_path": ..., "init_args": ...}`` for ``cls`` and its parsed arguments."""
    if isinstance(init_args, Namespace):
        init_args = init_args.as_dict()
    return {"class_path": class_path_of(cls), "init_args": dict(init_args or {})}


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """``init["class_path"]`` built with ``args`` (one value or a tuple of positional arguments)
    and the keywords ``init["init_args"]``: how a module builds the optimizer / scheduler a CLI
    linked to it (``instantiate_class(self.parameters(), optimizer_config)``)."""
    positional = args if isinstance(args, tuple) else (args,)
    module_name, _, name = init["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    return cls(*positional, **init.get("init_args", {}))
