"""Offload: ZeRO with fp32 master weights and optimizer state in host RAM or on NVMe.

Pieces, smallest first: ``plan`` (sub-groups and the read/step/write pipeline, pure), ``aio``
(thread-pool file I/O, O_DIRECT detection, atomic files), ``swapper`` (where each sub-group's
state lives: RAM or swap files; checkpoint snapshots), ``param_swap`` (ZeRO-3 parameter shards in
files, resident only while used), ``transfer`` (gradients to the optimizer and
working parameters back: host memory or a GPU), ``optimizer`` (the fused sub-group Adam step, and
the fallback for other optimizers), ``config`` (the validated policy) and ``strategy`` (the
``offload`` strategy composed with ZeRO stage 2 or 3).
"""
from __future__ import annotations

from .config import OffloadConfig
from .strategy import Offload, OffloadZeroStage2, OffloadZeroStage3

__all__ = ["Offload", "OffloadConfig", "OffloadZeroStage2", "OffloadZeroStage3"]
