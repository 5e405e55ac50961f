"""zerotrain: a Lightning-style Trainer whose strategies implement ZeRO 1/2/3, offload and
pipeline parallelism on torch.distributed."""
__version__ = "0.1.0"

from .callbacks import (Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar,  # noqa: E402
                        TensorBoardLogger, ThroughputMonitor)
from .trainer import CheckpointError, ConfigError, Trainer, TrainModule, seed_everything  # noqa: E402

__all__ = ["Trainer", "TrainModule", "Callback", "ModelCheckpoint", "LearningRateMonitor",
           "ThroughputMonitor", "ProgressBar", "TensorBoardLogger", "ConfigError", "CheckpointError",
           "seed_everything"]

from .trainer import DataModule  # noqa: E402

__all__ += ["DataModule"]
