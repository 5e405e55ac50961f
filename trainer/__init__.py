"""The training loop and the user's module."""
from .engine.engine import Engine
from .engine.fabric import Fabric
from .api.datamodule import DataModule
from .errors import CheckpointError, ConfigError
from .api.module import TrainModule
from .loop.trainer import Trainer
from .utilities import seed_everything

__all__ = ["Trainer", "Engine", "Fabric", "TrainModule", "DataModule", "ConfigError", "CheckpointError", "seed_everything"]
