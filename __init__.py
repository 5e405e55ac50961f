"""zerotrain: a Lightning-style Trainer whose strategies implement ZeRO 1/2/3, offload and
pipeline parallelism on torch.distributed, and an Engine that runs
the same strategies under a training loop you write yourself."""
from .trainer.version import __version__  # noqa: E402,F401

import sys as _sys

from .callbacks import (Callback, CSVLogger, EarlyStopping, LearningRateMonitor, ModelCheckpoint,  # noqa: E402
                        ModelSummary, ProgressBar, TensorBoardLogger, ThroughputMonitor, Timer, TQDMProgressBar)
from .trainer import CheckpointError, ConfigError, DataModule, Engine, Fabric, Trainer, TrainModule, seed_everything  # noqa: E402
from .strategies import (DDP, DDPStrategy, Offload, PipelineStrategy, SingleDevice, SingleDeviceStrategy,  # noqa: E402
                         Strategy, ZeroStage1, ZeroStage2, ZeroStage3)
from .callbacks import loggers  # noqa: E402
from .strategies import moe  # noqa: E402  (zerotrain.moe: the mixture-of-experts layer, strategies/moe/)
from .trainer.compat import core, deepspeed, fabric_paths, lightning_paths
from .trainer import demos, utilities  # noqa: E402
from .trainer.cli import cli_lightning_logo  # noqa: E402  (Lightning's examples print it)

# Lightning's module paths, so that ported code only renames `lightning.pytorch` to `zerotrain`:
# zerotrain.loggers / .utilities / .core / .demos and their deeper paths (zerotrain.core.module,
# zerotrain.utilities.exceptions, ...) are modules of the existing packages, registered under those
# names (trainer/compat/lightning_paths.py; the repository's top-level folders stay as they are).
lightning_paths.register(__name__)
# Lightning Fabric's (``lightning.fabric`` -> ``zerotrain.fabric``): trainer/compat/fabric_paths.py
fabric_paths.register(__name__)
# DeepSpeed's module paths, so that a DeepSpeed script only renames its imports
# (``import zerotrain.deepspeed as deepspeed``): trainer/compat/deepspeed/ and every module in it, registered
# eagerly so that either path gives the same module object.
_sys.modules[f"{__name__}.deepspeed"] = deepspeed
for _name, _module in deepspeed.SUBMODULES.items():
    _sys.modules[f"{__name__}.deepspeed.{_name}"] = _module
_sys.modules[f"{__name__}.moe"] = moe
del _name, _module, lightning_paths, fabric_paths

__all__ = ["Trainer", "Engine", "Fabric", "TrainModule", "DataModule", "Callback", "ModelCheckpoint", "EarlyStopping", "Timer",
           "ModelSummary", "LearningRateMonitor", "ThroughputMonitor", "ProgressBar", "TQDMProgressBar",
           "TensorBoardLogger", "CSVLogger", "ConfigError", "CheckpointError", "seed_everything",
           # the strategies (zerotrain.strategies has them all)
           "Strategy", "SingleDevice", "SingleDeviceStrategy", "DDP", "DDPStrategy", "ZeroStage1", "ZeroStage2",
           "ZeroStage3", "Offload", "PipelineStrategy"]
