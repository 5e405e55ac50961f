"""The default *stepper* of a ZeRO strategy: the user's optimizer steps this rank's fp32 master
slices on the working device (:class:`~.sharded_optimizer.ShardedOptimizer`).

A stepper is the optimizer part of a ZeRO strategy, composed into it (``ZeroStrategy(stepper=)``):
the stage owns working parameters, gradient reduction and gathering and calls the stepper for
the pieces of ``Strategy.optimizer_step`` that depend on where the masters live. The other stepper
is offload's (:class:`~..offload.stepper.OffloadStepper`: masters and state in host RAM or on NVMe);
both have the methods below.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from .comm.grad_norm import Reader, slice_reader
from .sharded_optimizer import ShardedOptimizer


class ShardedStepper:
    #: the strategy keeps its stage's name
    name = None
    #: the stage's memory formula holds
    formula = True
    policy = None

    def __init__(self) -> None:
        self._grads: list[torch.Tensor] | None = None

    def check_stage(self, stage: int) -> None:
        pass

    def check(self, stage: int, device: torch.device, optimizer: torch.optim.Optimizer,
              precision: Any = None) -> None:
        pass

    def build_chunks(self, rank: int) -> Any:
        """Where ZeRO-3's partitioned build keeps this rank's chunks (None: RAM)."""
        return None

    def place_unit(self, unit: Any, rank: int) -> None:
        pass

    def page_units(self, order: Any) -> None:
        pass

    def setup(self, sharded: ShardedOptimizer, *args: Any) -> ShardedOptimizer:
        return sharded

    # ------------------------------------------------------------------ pieces of the step
    def gradients(self, partitions: list[torch.Tensor], sharded: ShardedOptimizer) -> list[torch.Tensor]:
        """fp32 copies of this rank's reduced gradient slices (the partitions themselves when fp32),
        attached to the master slices."""
        if self._grads is None:
            self._grads = [g if g.dtype == torch.float32 else g.float() for g in partitions]
            sharded.set_grads(self._grads)
        return self._grads

    def norm_reader(self, grads: list[torch.Tensor]) -> Reader:
        """How the per-parameter gradient norms read ranges of the gradient slots ``grads``."""
        return slice_reader(grads)

    def norm_factor(self) -> float:
        """What the gradients' norm is multiplied by (a clip coefficient not applied to them yet)."""
        return 1.0

    def scale(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))

    def clamp(self, grads: list[torch.Tensor], value: float, loss_scale: float) -> None:
        """Value clipping: element-wise, so this rank's partitions clamp its share of the gradient."""
        for g in grads:
            g.detach().clamp_(-value, value)

    def step(self, sharded: ShardedOptimizer, loss_scale: float) -> None:
        sharded.step()

    def zero(self, sharded: ShardedOptimizer) -> None:
        sharded.clear_grads()
        self._grads = None

    def zero_grads(self, slots: list[int] | None) -> None:
        """The stage zeroes its gradient partitions (of master slots ``slots``): nothing of them here."""

    def before_refresh(self, sharded: ShardedOptimizer) -> None:
        pass

    def took_working(self) -> bool:
        """ZeRO-3, before it refreshes the working shards: did the last step write them already?
        (No: the optimizer steps the masters; a low-precision working shard is copied from them.)"""
        return False

    def updated(self, sharded: ShardedOptimizer, working: list[torch.Tensor]) -> list[torch.Tensor]:
        """What stages 1/2 all-gather after a step: the updated master slices."""
        return [m.detach() for m in sharded.masters]

    def exposed_state(self, sharded: ShardedOptimizer) -> "contextlib.AbstractContextManager":
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ memory, reports, end
    def adjust_memory(self, out: dict[str, list[torch.Tensor]], sharded: Any) -> None:
        pass

    def report(self, sharded: Any, stage: int) -> dict[str, Any]:
        return {"stage": stage, "optimizer_device": "none", "param_device": "none"}

    def log_setup(self, sharded: Any, stage: int) -> None:
        pass

    def teardown(self) -> None:
        pass

    def __repr__(self) -> str:
        return "ShardedStepper()"
