"""Lightning Fabric's module paths under ``zerotrain``: the rename rule maps ``lightning`` to
``zerotrain``, so ``lightning.fabric`` is ``zerotrain.fabric`` (``from zerotrain.fabric import
Fabric``, ``from zerotrain.fabric.utilities.seed import seed_everything``). Each path holds our
own objects under Lightning's names: ``MODULES`` registers one of our modules under the path
(as ``lightning_paths.py`` does for ``lightning.pytorch``); ``NAMESPACES`` makes a small module
for a path whose names live in several of ours. Paths and names not listed are not provided
(README "Import paths": Fabric's accelerators and strategies); cluster environments and precision
plugins are names only (trainer/compat/lightning/plugins.py)."""
from __future__ import annotations

import importlib
import types

from .lightning_paths import install

#: Lightning's path (after ``lightning.fabric.``) -> our module, whose names it shows
MODULES = {
    "utilities": "trainer.utilities",
    "utilities.seed": "trainer.utilities",
    "utilities.rank_zero": "trainer.utilities",
    "utilities.warnings": "trainer.utilities",
    "utilities.imports": "trainer.compat.imports",
    "utilities.exceptions": "trainer.errors",
    "utilities.data": "trainer.compat.lightning.data",
    "utilities.logger": "trainer.compat.lightning.params",
    "utilities.types": "trainer.compat.lightning.types",
    "loggers": "trainer.compat._fabric_loggers",
    "loggers.tensorboard": "trainer.compat._fabric_loggers",
    "loggers.csv_logs": "trainer.compat._fabric_loggers",
    "loggers.logger": "trainer.compat._fabric_loggers",
    "plugins": "trainer.compat.lightning.plugins",
    "plugins.io": "trainer.compat.lightning.plugins",
    "plugins.io.checkpoint_io": "trainer.compat.lightning.plugins",
    "plugins.io.torch_io": "trainer.compat.lightning.plugins",
    "plugins.environments": "trainer.compat.lightning.plugins",
    "plugins.precision": "trainer.compat.lightning.plugins",
}
#: Lightning's path -> {Lightning's name: "our module:our name"}; "" is ``zerotrain.fabric`` itself
NAMESPACES = {
    "": {"Fabric": "trainer.engine.fabric:Fabric", "seed_everything": "trainer.utilities:seed_everything",
         "disable_possible_user_warnings": "trainer.utilities:disable_possible_user_warnings"},
    "utilities.cloud_io": {"_load": "trainer.api.from_checkpoint:load_checkpoint"},
    "utilities.distributed": {"_distributed_is_initialized": "trainer.utilities:distributed_is_initialized"},
}


def _namespace(name: str, names: dict[str, str], package: str) -> types.ModuleType:
    module = types.ModuleType(name, f"Lightning's ``{name.replace(package, 'lightning', 1)}`` names, "
                                    f"zerotrain's objects (trainer/compat/fabric_paths.py).")
    module.__path__ = []  # a package: its deeper paths are registered beside it
    for leaf, target in names.items():
        where, _, attr = target.partition(":")
        setattr(module, leaf, getattr(importlib.import_module(f"{package}.{where}"), attr))
    module.__all__ = [n for n in names if not n.startswith("_")]
    return module


def register(package: str) -> None:
    """Register ``{package}.fabric`` and every path below it, parents first."""
    paths = {alias: alias for alias in (*MODULES, *NAMESPACES)}
    for alias in sorted(paths, key=lambda a: (a != "", a.count("."))):
        name = f"{package}.fabric" + (f".{alias}" if alias else "")
        if alias in NAMESPACES:
            module = _namespace(name, NAMESPACES[alias], package)
        else:
            module = importlib.import_module(f"{package}.{MODULES[alias]}")
        install(name, module)
