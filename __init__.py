"""zerotrain: a Lightning-style Trainer whose strategies implement ZeRO 1/2/3, offload and
pipeline parallelism on torch.distributed, and an Engine that runs
the same strategies under a training loop you write yourself."""
__version__ = "0.1.0"

from .callbacks import (Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar,  # noqa: E402
                        TensorBoardLogger, ThroughputMonitor)
from .trainer import CheckpointError, ConfigError, Engine, Trainer, TrainModule, seed_everything  # noqa: E402

__all__ = ["Trainer", "Engine", "TrainModule", "Callback", "ModelCheckpoint", "LearningRateMonitor",
           "ThroughputMonitor", "ProgressBar", "TensorBoardLogger", "ConfigError", "CheckpointError",
           "seed_everything"]
