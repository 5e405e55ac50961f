"""The training loop and the user's module."""
from .engine import Engine
from .fabric import Fabric
from .datamodule import DataModule
from .errors import CheckpointError, ConfigError
from .module import TrainModule
from .trainer import Trainer
from .utilities import seed_everything

__all__ = ["Trainer", "Engine", "Fabric", "TrainModule", "DataModule", "ConfigError", "CheckpointError", "seed_everything"]
