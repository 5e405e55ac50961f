"""``zerotrain.cli``: Lightning's ``LightningCLI`` (``lightning.pytorch.cli``) for zerotrain, built
on jsonargparse as Lightning's is. The names load on first use (PEP 562), so that ``import
zerotrain`` does not import jsonargparse; ``zerotrain-train`` (Hydra, ``trainer/command/config.py``) is
the other command line and is independent of this one.

* ``lightning_cli.py``: ``LightningCLI`` and ``instantiate_module`` (``load_from_checkpoint`` of a
  module the CLI built);
* ``parser.py``: ``LightningArgumentParser``, ``instantiate_class``, the optimizer / scheduler types;
* ``save_config.py``: ``SaveConfigCallback``;
* ``main``: the Hydra command line (``zerotrain-train``) for a script's own classes,
  ``zerotrain.cli.main(MyModule, MyData)`` (``train.py``'s ``main``).

May import: trainer.api, trainer.checkpoint, trainer.errors, trainer.loop, trainer.utilities, callbacks."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "LightningCLI": "lightning_cli", "instantiate_module": "lightning_cli",
    "SaveConfigCallback": "save_config",
    **{name: "parser" for name in (
        "LightningArgumentParser", "instantiate_class", "ReduceLROnPlateau", "LRSchedulerTypeTuple",
        "LRSchedulerTypeUnion", "LRSchedulerType", "ArgsType", "OptimizerCallable", "LRSchedulerCallable",
        "_JSONARGPARSE_SIGNATURES_AVAILABLE")},
}
#: jsonargparse's names a CLI script imports from Lightning's module
_JSONARGPARSE = ("ActionConfigFile", "ArgumentParser", "Namespace", "class_from_function", "lazy_instance")

__all__ = ["LightningCLI", "LightningArgumentParser", "SaveConfigCallback", "instantiate_class", "instantiate_module",
           "ReduceLROnPlateau", "LRSchedulerTypeTuple", "LRSchedulerTypeUnion", "LRSchedulerType", "ArgsType",
           "OptimizerCallable", "LRSchedulerCallable", "cli_lightning_logo"]

_LOGO = """
  +------------------------------------------+
  |  zerotrain  -  ZeRO 1/2/3, one Trainer   |
  +------------------------------------------+
"""


def cli_lightning_logo() -> None:
    """The banner Lightning's example scripts print before their CLI runs (zerotrain's own)."""
    print(_LOGO)


def __getattr__(name: str) -> Any:
    if name == "main":  # the Hydra command line, not this package's jsonargparse one
        value = importlib.import_module("zerotrain.train").main
    elif name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    elif name in _JSONARGPARSE:
        value = getattr(importlib.import_module("jsonargparse"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_JSONARGPARSE, "main"})
