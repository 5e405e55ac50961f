"""Strategies: how model and optimizer are wrapped, partitioned and communicated."""
from .base import Strategy
from .ddp import DDP
from .environment import ProcessInfo
from .precision import Precision, precision_from_name
from .registry import available, register, strategy_from_name
from .single_device import SingleDevice

__all__ = ["Strategy", "DDP", "SingleDevice", "ProcessInfo", "Precision", "precision_from_name",
           "available", "register", "strategy_from_name"]
