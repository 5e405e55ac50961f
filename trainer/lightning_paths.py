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
    "core": "trainer.core",
    "demos": "trainer.demos",
    "cli": "trainer.cli",  # LightningCLI (its names load on first use: jsonargparse is imported then)
    # lightning.pytorch.core.*
    "core.module": "trainer.module",
    "core.datamodule": "trainer.datamodule",
    "core.hooks": "trainer.datamodule",
    "core.saving": "trainer.saving",
    "core.optimizer": "trainer.optimization",
    "core.mixins": "trainer.hparams",
    "core.mixins.hparams_mixin": "trainer.hparams",
    # lightning.pytorch.demos.*
    "demos.boring_classes": "trainer.demos",
    "demos.transformer": "trainer.demo_transformer",
    "demos.mnist_datamodule": "trainer.demo_mnist",
    # lightning.pytorch.loggers.*
    "loggers.logger": "callbacks.base",
    "loggers.csv_logs": "callbacks.loggers",
    "loggers.tensorboard": "callbacks.tensorboard",
    # lightning.pytorch.utilities.*
    "utilities.exceptions": "trainer.errors",
    "utilities.imports": "trainer.imports",
    "utilities.model_helpers": "trainer.utilities",
    "utilities.rank_zero": "trainer.utilities",
    "utilities.seed": "trainer.utilities",
    "utilities.parsing": "trainer.hparams",
    "utilities.warnings": "trainer.utilities",
    # lightning.pytorch.callbacks.* (our callbacks/ modules have shorter names)
    "callbacks.callback": "callbacks.base",
    "callbacks.model_checkpoint": "callbacks.checkpoint",
    "callbacks.lr_monitor": "callbacks.monitors",
    "callbacks.throughput_monitor": "callbacks.monitors",
    "callbacks.model_summary": "callbacks.summary",
    "callbacks.finetuning": "callbacks.finetuning",
    "callbacks.lambda_function": "callbacks.lambda_function",
    "callbacks.gradient_accumulation_scheduler": "callbacks.schedules",
    "callbacks.on_exception_checkpoint": "callbacks.schedules",
    "callbacks.device_stats_monitor": "callbacks.schedules",
    "callbacks.progress.progress_bar": "callbacks.progress",
    "callbacks.progress.rich_progress": "callbacks.rich_progress",
    "callbacks.rich_model_summary": "callbacks.rich_progress",
    "callbacks.progress.tqdm_progress": "callbacks.progress",
    "callbacks.stochastic_weight_avg": "callbacks.tuning.swa",
    # lightning.pytorch.trainer.*
    "trainer.states": "trainer.state",
    # Lightning's modules zerotrain has no counterpart of: trainer/compat/ (small honest shims;
    # Lightning's loop, connector and launcher objects are importable names only)
    "accelerators": "trainer.compat.accelerators",
    "accelerators.accelerator": "trainer.compat.accelerators",
    "accelerators.cpu": "trainer.compat.accelerators",
    "accelerators.cuda": "trainer.compat.accelerators",
    "profilers": "trainer.compat.profilers",
    "profilers.profiler": "trainer.compat.profilers",
    "profilers.base": "trainer.compat.profilers",
    "profilers.simple": "trainer.compat.profilers",
    "profilers.pytorch": "trainer.compat.torch_profiler",
    "tuner": "trainer.compat.tuner",
    "tuner.tuning": "trainer.compat.tuner",
    "loops": "trainer.compat.internals",
    "loops.loop": "trainer.compat.internals",
    "loops.fit_loop": "trainer.compat.internals",
    "loops.training_epoch_loop": "trainer.compat.internals",
    "loops.evaluation_loop": "trainer.compat.internals",
    "loops.prediction_loop": "trainer.compat.internals",
    "loops.utilities": "trainer.compat.internals",
    "loops.optimization": "trainer.compat.internals",
    "loops.optimization.automatic": "trainer.compat.internals",
    "loops.progress": "trainer.compat.internals",
    "overrides": "trainer.compat.internals",
    "overrides.distributed": "trainer.compat.internals",
    "strategies.strategy": "strategies.base",
    "strategies.launchers": "trainer.compat.internals",
    "strategies.launchers.multiprocessing": "trainer.compat.internals",
    "strategies.launchers.subprocess_script": "trainer.compat.internals",
    "plugins": "trainer.compat.plugins",
    "plugins.io": "trainer.compat.plugins",
    "plugins.io.async_plugin": "trainer.compat.plugins",
    "plugins.layer_sync": "trainer.compat.plugins",
    "plugins.environments": "trainer.compat.plugins",
    "plugins.precision": "trainer.compat.plugins",
    "plugins.precision.precision": "trainer.compat.plugins",
    "plugins.precision.double": "trainer.compat.plugins",
    "trainer.connectors": "trainer.compat.data",
    "trainer.connectors.data_connector": "trainer.compat.data",
    "trainer.connectors.logger_connector": "trainer.compat.internals",
    "trainer.connectors.logger_connector.fx_validator": "trainer.compat.internals",
    "trainer.connectors.logger_connector.result": "trainer.compat.internals",
    "trainer.configuration_validator": "trainer.compat.validator",
    "utilities.data": "trainer.compat.data",
    "utilities.types": "trainer.compat.types",
    "utilities.combined_loader": "trainer.compat.combined_loader",
    "loggers.utilities": "trainer.compat.params",
    "loggers.comet": "trainer.compat.service_loggers",
    "loggers.mlflow": "trainer.compat.service_loggers",
    "loggers.neptune": "trainer.compat.service_loggers",
    "loggers.wandb": "trainer.compat.service_loggers",
    "loggers.litlogger": "trainer.compat.service_loggers",
}

#: names Lightning has in a module where ours has none (set on the module at registration):
#: Lightning's path -> {Lightning's name: "our module:our name"}
NAMES = {
    "utilities": {"CombinedLoader": "trainer.compat.combined_loader:CombinedLoader"},
    "strategies": {"SingleDeviceXLAStrategy": "trainer.compat.internals:SingleDeviceXLAStrategy"},
    "callbacks": {"BasePredictionWriter": "callbacks.prediction_writer:BasePredictionWriter"},
    "core.module": {"_TrainerFabricShim": "trainer.compat.internals:_TrainerFabricShim"},
    "loggers.logger": {"DummyExperiment": "callbacks.base:_DummyExperiment"},
    "loggers": {name: f"trainer.compat.service_loggers:{name}"
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
