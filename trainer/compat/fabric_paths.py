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
    "plugins.collectives": "trainer.compat.fabric_collectives",
    "plugins.collectives.collective": "trainer.compat.fabric_collectives",
    "plugins.collectives.torch_collective": "trainer.compat.fabric_collectives",
    "plugins.collectives.single_device": "trainer.compat.fabric_collectives",
    "fabric": "trainer.engine.fabric",
    "utilities.apply_func": "trainer.compat.fabric_names",
    "utilities.device_dtype_mixin": "trainer.compat.fabric_names",
}
#: Lightning's path -> {Lightning's name: "our module:our name"}; "" is ``zerotrain.fabric`` itself
NAMESPACES = {
    "": {"Fabric": "trainer.engine.fabric:Fabric", "seed_everything": "trainer.utilities:seed_everything",
         "disable_possible_user_warnings": "trainer.utilities:disable_possible_user_warnings"},
    "utilities.cloud_io": {"_load": "trainer.api.from_checkpoint:load_checkpoint"},
    "utilities.distributed": {"_distributed_is_initialized": "trainer.utilities:distributed_is_initialized"},
    "wrappers": {"_FabricModule": "trainer.engine.wrappers:EngineModule",
                 "_FabricOptimizer": "trainer.engine.wrappers:EngineOptimizer",
                 "_FabricDataLoader": "trainer.engine.wrappers:EngineLoader",
                 **{n: f"trainer.compat.fabric_names:{n}" for n in ("is_wrapped", "_unwrap_objects", "_unwrap_compiled")}},
    "strategies": {"Strategy": "strategies.base:Strategy", "DDPStrategy": "strategies:DDPStrategy",
                   "SingleDeviceStrategy": "strategies:SingleDeviceStrategy",
                   "ModelParallelStrategy": "strategies.model_parallel:FabricModelParallelStrategy",
                   **{n: f"trainer.compat.fabric_names:{n}" for n in (
                       "ParallelStrategy", "DataParallelStrategy", "DeepSpeedStrategy", "FSDPStrategy",
                       "XLAStrategy", "XLAFSDPStrategy")}},
    "strategies.strategy": {"Strategy": "strategies.base:Strategy", "_Sharded": "trainer.compat.fabric_names:_Sharded"},
    "plugins.precision.utils": {"_DtypeContextManager": "trainer.compat.fabric_names:_DtypeContextManager"},
}
#: names set on a module registered above (Lightning's path -> {name: "our module:our name"}), where
#: Fabric's module has names ours has not (private helpers its tests import)
EXTRA = {
    "utilities.seed": {"pl_worker_init_function": "trainer.compat.lightning.data:seed_worker",
                       **{n: f"trainer.compat.fabric_names:{n}"
                          for n in ("_collect_rng_states", "_set_rng_states", "_generate_seed_sequence")}},
    "utilities.rank_zero": {n: f"trainer.compat.fabric_names:{n}" for n in ("_get_rank", "rank_zero_deprecation")},
    "utilities.warnings": {"_is_path_in_lightning": "trainer.compat.fabric_names:_is_path_in_lightning"},
    "utilities.logger": {"_convert_json_serializable": "trainer.compat.fabric_names:_convert_json_serializable"},
    "utilities.types": {"Optimizable": "trainer.compat.fabric_names:Optimizable",
                        **{n: f"trainer.compat.fabric_collectives:{n}"
                           for n in ("CollectibleGroup", "ReduceOp", "RedOpType")}},
    "utilities.data": {"AttributeDict": "trainer.api.hparams:AttributeDict",
                       **{n: f"trainer.compat.fabric_names:{n}" for n in (
                           "_set_sampler_epoch", "_update_dataloader", "_get_dataloader_init_args_and_kwargs",
                           "_replace_dunder_methods", "_replace_value_in_saved_args", "_WrapAttrTag")}},
    "loggers.csv_logs": {"_ExperimentWriter": "callbacks.loggers:ExperimentWriter"},
    "loggers.tensorboard": {"_TENSORBOARD_AVAILABLE": "trainer.compat.fabric_names:_TENSORBOARD_AVAILABLE"},
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
    for alias, names in EXTRA.items():
        module = importlib.import_module(f"{package}.fabric.{alias}")
        for leaf, target in names.items():
            where, _, attr = target.partition(":")
            if not hasattr(module, leaf):
                setattr(module, leaf, getattr(importlib.import_module(f"{package}.{where}"), attr))
