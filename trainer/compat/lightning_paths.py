"""Lightning's module paths under ``zerotrain``: ported code renames ``lightning.pytorch`` (or
``pytorch_lightning``) to ``zerotrain`` and keeps the rest of the path. Each path below is one of
our modules registered under Lightning's name (``sys.modules`` and an attribute of its parent),
so ``import zerotrain.core.module`` and ``from zerotrain.loggers.csv_logs import CSVLogger`` work
while the repository's top-level folders stay as they are. README "Import paths" lists them."""
from __future__ import annotations

import importlib
import sys

#: Lightning's path (after ``lightning.pytorch.``) -> our module (relative to the package)
PATHS = {
    # the first-level ones
    "loggers": "callbacks.loggers",
    "utilities": "trainer.utilities",
    "core": "trainer.compat.core",
    "demos": "trainer.demos",
    "cli": "trainer.cli",  # LightningCLI (its names load on first use: jsonargparse is imported then)
    # lightning.pytorch.core.*
    "core.module": "trainer.api.module",
    "core.datamodule": "trainer.api.datamodule",
    "core.hooks": "trainer.api.datamodule",
    "core.saving": "trainer.api.saving",
    "core.optimizer": "trainer.optim.optimization",
    "core.mixins": "trainer.api.hparams",
    "core.mixins.hparams_mixin": "trainer.api.hparams",
    # lightning.pytorch.demos.*
    "demos.boring_classes": "trainer.demos.boring_classes",
    "demos.transformer": "trainer.demos.transformer",
    "demos.mnist_datamodule": "trainer.demos.mnist_datamodule",
    # lightning.pytorch.loggers.*
    "loggers.logger": "callbacks.base",
    "loggers.csv_logs": "callbacks.loggers",
    "loggers.tensorboard": "callbacks.loggers.tensorboard",
    # lightning.pytorch.utilities.*
    "utilities.exceptions": "trainer.errors",
    "utilities.imports": "trainer.compat.imports",
    "utilities.model_helpers": "trainer.utilities",
    "utilities.rank_zero": "trainer.utilities",
    "utilities.seed": "trainer.utilities",
    "utilities.parsing": "trainer.api.hparams",
    "utilities.warnings": "trainer.utilities",
    # lightning.pytorch.callbacks.* (our callbacks/ modules have shorter names)
    "callbacks.callback": "callbacks.base",
    "callbacks.model_checkpoint": "callbacks.checkpoint",
    "callbacks.lr_monitor": "callbacks.measure.monitors",
    "callbacks.throughput_monitor": "callbacks.measure.monitors",
    "callbacks.model_summary": "callbacks.summary",
    "callbacks.finetuning": "callbacks.finetuning",
    "callbacks.lambda_function": "callbacks.lambda_function",
    "callbacks.gradient_accumulation_scheduler": "callbacks.schedules",
    "callbacks.on_exception_checkpoint": "callbacks.schedules",
    "callbacks.device_stats_monitor": "callbacks.schedules",
    "callbacks.progress.progress_bar": "callbacks.progress",
    "callbacks.progress.rich_progress": "callbacks.progress.rich_progress",
    "callbacks.rich_model_summary": "callbacks.progress.rich_progress",
    "callbacks.progress.tqdm_progress": "callbacks.progress",
    "callbacks.stochastic_weight_avg": "callbacks.tuning.swa",
    "callbacks.lr_finder": "callbacks.tuning.lr_finder",
    "callbacks.batch_size_finder": "callbacks.tuning.batch_size_finder",
    # lightning.pytorch.trainer.*
    "trainer.states": "trainer.loop.state",
    "trainer.trainer": "trainer.loop.trainer",  # was trainer/trainer.py itself before the rooms
    # Lightning's modules zerotrain has no counterpart of: trainer/compat/ (small honest shims;
    # Lightning's loop, connector and launcher objects are importable names only)
    "accelerators": "trainer.compat.lightning.accelerators",
    "accelerators.accelerator": "trainer.compat.lightning.accelerators",
    "accelerators.cpu": "trainer.compat.lightning.accelerators",
    "accelerators.cuda": "trainer.compat.lightning.accelerators",
    "profilers": "trainer.compat.lightning.profilers",
    "profilers.profiler": "trainer.compat.lightning.profilers",
    "profilers.base": "trainer.compat.lightning.profilers",
    "profilers.simple": "trainer.compat.lightning.profilers",
    "profilers.pytorch": "trainer.compat.lightning.profilers",
    "tuner": "callbacks.tuning.tuner",
    "tuner.tuning": "callbacks.tuning.tuner",
    "tuner.lr_finder": "callbacks.tuning.lr_finder",
    "tuner.batch_size_scaling": "callbacks.tuning.batch_size_finder",
    "loops": "trainer.compat.lightning.internals",
    "loops.loop": "trainer.compat.lightning.internals",
    "loops.fit_loop": "trainer.compat.lightning.internals",
    "loops.training_epoch_loop": "trainer.compat.lightning.internals",
    "loops.evaluation_loop": "trainer.compat.lightning.internals",
    "loops.prediction_loop": "trainer.compat.lightning.internals",
    "loops.utilities": "trainer.compat.lightning.internals",
    "loops.optimization": "trainer.compat.lightning.internals",
    "loops.optimization.automatic": "trainer.compat.lightning.internals",
    "loops.progress": "trainer.compat.lightning.internals",
    "overrides": "trainer.compat.lightning.internals",
    "overrides.distributed": "trainer.compat.lightning.internals",
    "strategies.strategy": "strategies.base",
    "strategies.launchers": "trainer.compat.lightning.internals",
    "strategies.launchers.multiprocessing": "trainer.compat.lightning.internals",
    "strategies.launchers.subprocess_script": "trainer.compat.lightning.internals",
    "plugins": "trainer.compat.lightning.plugins",
    "plugins.io": "trainer.compat.lightning.plugins",
    "plugins.io.async_plugin": "trainer.compat.lightning.plugins",
    "plugins.layer_sync": "trainer.compat.lightning.plugins",
    "plugins.environments": "trainer.compat.lightning.plugins",
    "plugins.precision": "trainer.compat.lightning.plugins",
    "plugins.precision.precision": "trainer.compat.lightning.plugins",
    "plugins.precision.double": "trainer.compat.lightning.plugins",
    "trainer.connectors": "trainer.compat.lightning.data",
    "trainer.connectors.data_connector": "trainer.compat.lightning.data",
    "trainer.connectors.logger_connector": "trainer.compat.lightning.internals",
    "trainer.connectors.logger_connector.fx_validator": "trainer.compat.lightning.internals",
    "trainer.connectors.logger_connector.result": "trainer.compat.lightning.internals",
    "trainer.configuration_validator": "trainer.compat.lightning.validator",
    "utilities.data": "trainer.compat.lightning.data",
    "utilities.types": "trainer.compat.lightning.types",
    "utilities.combined_loader": "trainer.compat.lightning.combined_loader",
    "loggers.utilities": "trainer.compat.lightning.params",
    "loggers.comet": "trainer.compat.lightning.service_loggers",
    "loggers.mlflow": "trainer.compat.lightning.service_loggers",
    "loggers.neptune": "trainer.compat.lightning.service_loggers",
    "loggers.wandb": "trainer.compat.lightning.service_loggers",
    "loggers.litlogger": "trainer.compat.lightning.service_loggers",
}

#: names Lightning has in a module where ours has none (set on the module at registration):
#: Lightning's path -> {Lightning's name: "our module:our name"}
NAMES = {
    "utilities": {"CombinedLoader": "trainer.compat.lightning.combined_loader:CombinedLoader"},
    "utilities.parsing": {name: f"callbacks.tuning.attrs:{name}"
                          for name in ("lightning_hasattr", "lightning_getattr", "lightning_setattr")},
    "strategies": {"SingleDeviceXLAStrategy": "trainer.compat.lightning.internals:SingleDeviceXLAStrategy"},
    "callbacks": {"BasePredictionWriter": "callbacks.prediction_writer:BasePredictionWriter"},
    "core.module": {"_TrainerFabricShim": "trainer.compat.lightning.internals:_TrainerFabricShim"},
    "loggers.logger": {"DummyExperiment": "callbacks.base:_DummyExperiment"},
    "loggers": {name: f"trainer.compat.lightning.service_loggers:{name}"
                for name in ("CometLogger", "MLFlowLogger", "NeptuneLogger", "WandbLogger")},
}


def install(name: str, module: object) -> None:
    """``module`` importable as ``name`` (``sys.modules``) and, unless the parent (registered
    first) already has that attribute, reachable as its attribute."""
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    if not hasattr(sys.modules[parent], leaf):
        setattr(sys.modules[parent], leaf, module)


def register(package: str) -> None:
    """Register every path of ``PATHS`` under ``package`` (``zerotrain``), parents first."""
    for alias in sorted(PATHS, key=lambda a: a.count(".")):
        install(f"{package}.{alias}", importlib.import_module(f"{package}.{PATHS[alias]}"))
    for alias, names in NAMES.items():
        module = sys.modules.get(f"{package}.{alias}") or importlib.import_module(f"{package}.{alias}")
        for leaf, target in names.items():
            where, _, attr = target.partition(":")
            if not hasattr(module, leaf):
                setattr(module, leaf, getattr(importlib.import_module(f"{package}.{where}"), attr))
