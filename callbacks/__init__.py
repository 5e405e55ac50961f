"""Callbacks observe the run; loggers receive its metrics."""
from .base import Callback, Logger
from .checkpoint import ModelCheckpoint
from .monitors import LearningRateMonitor, ThroughputMonitor
from .progress import ProgressBar
from .tensorboard import TensorBoardLogger

__all__ = ["Callback", "Logger", "ModelCheckpoint", "LearningRateMonitor", "ThroughputMonitor",
           "ProgressBar", "TensorBoardLogger"]
