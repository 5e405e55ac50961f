"""Callbacks observe the run; loggers receive its metrics.

May import: trainer.api, trainer.checkpoint, trainer.compat, trainer.errors, trainer.loop, trainer.optim, trainer.utilities, strategies, ops."""
from .base import Callback, Logger
from .checkpoint import ModelCheckpoint
from .measure.comms import CommsLogger
from .early_stopping import EarlyStopping
from .finetuning import BackboneFinetuning, BaseFinetuning
from .measure.flops import FlopsProfiler
from .lambda_function import LambdaCallback
from .loggers import CSVLogger
from .measure.monitors import LearningRateMonitor, ThroughputMonitor
from .progress import ProgressBar, TQDMProgressBar
from .measure.resources import ResourceMonitor
from .progress.rich_progress import RichModelSummary, RichProgressBar, RichProgressBarTheme
from .schedules import DeviceStatsMonitor, GradientAccumulationScheduler, OnExceptionCheckpoint
from .summary import ModelSummary
from .loggers.tensorboard import TensorBoardLogger
from .timer import Timer
from .tuning import BatchSizeFinder, LearningRateFinder, StochasticWeightAveraging

__all__ = ["Callback", "Logger", "ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "ThroughputMonitor",
           "ModelSummary", "ProgressBar", "TQDMProgressBar", "Timer", "TensorBoardLogger", "CSVLogger",
           "ResourceMonitor", "CommsLogger", "FlopsProfiler", "BaseFinetuning", "BackboneFinetuning",
           "GradientAccumulationScheduler", "OnExceptionCheckpoint", "DeviceStatsMonitor", "RichProgressBar",
           "RichProgressBarTheme", "RichModelSummary", "LambdaCallback", "StochasticWeightAveraging",
           "LearningRateFinder", "BatchSizeFinder"]
