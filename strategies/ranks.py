"""Where this process sits among the ranks, and the collectives every strategy offers the
Trainer (``reduce``, ``any_rank``, ``barrier``, ``broadcast``): the base of ``Strategy``.

May import ``environment``, ``instrument`` and ``progress`` only.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import instrument, progress
from .environment import ProcessInfo


class Ranks:
    """This process's place (``info``, set by ``connect``) and its collectives over the job's
    ranks; a strategy that splits ranks another way (pipeline stages) overrides the
    ``data_parallel_*`` properties."""

    info: ProcessInfo
    device: torch.device
    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def global_rank(self) -> int:
        return self.info.global_rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self.info.global_rank == 0

    @property
    def data_parallel_world_size(self) -> int:
        """How many replicas see different data (the Trainer's DistributedSampler uses this).
        Equal to world_size unless a strategy splits ranks another way (pipeline stages)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ collectives
    def reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Sum or mean over ranks (SUM then divide: ReduceOp.AVG is unreliable on gloo)."""
        if op not in ("mean", "sum", "max"):
            raise ValueError(f"reduce op={op!r}; valid choices: mean, sum, max")
        t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None)
        t = t.detach().clone().to(self.device)
        if self.distributed:
            progress.mark("all_reduce (Strategy.reduce)")
            with instrument.blocking("all_reduce", t, control=True):
                dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "mean":
                t = t / self.world_size
        return t

    def any_rank(self, flag: bool) -> bool:
        if not self.distributed:
            return bool(flag)
        return bool(self.reduce(torch.tensor(float(flag)), op="max").item() > 0)

    def barrier(self) -> None:
        if self.distributed:
            progress.mark("barrier")
            with instrument.blocking("barrier", None, control=True):
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        progress.mark("broadcast")
        with instrument.blocking("broadcast_object", None, control=True):
            dist.broadcast_object_list(box, src=src)
        return box[0]
