"""The training loop and the user's module."""
from .engine import Engine
from .datamodule import DataModule
from .errors import CheckpointError, ConfigError
from .module import TrainModule
from .trainer import Trainer
from .utilities import seed_everything

__all__ = ["Trainer", "Engine", "TrainModule", "DataModule", "ConfigError", "CheckpointError", "seed_everything"]
