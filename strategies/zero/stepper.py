"""The default *stepper* of a ZeRO strategy: the user's optimizer steps this rank's fp32 master
slices on the working device (:class:`~.sharded_optimizer.ShardedOptimizer`).

A stepper is the optimizer part of a ZeRO strategy, composed into it (``ZeroStrategy(stepper=)``):
the stage owns working parameters, gradient reduction and gathering and calls the stepper for
the pieces of ``Strategy.optimizer_step`` that depend on where the masters live. The other stepper
is offload's (:class:`~..offload.stepper.OffloadStepper`: masters and state in host RAM or on NVMe);
both satisfy :class:`Stepper`, the seam's type (``ZeroStrategy.stepper``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from .comm.grad_norm import Reader, slice_reader
from .sharded_optimizer import ShardedOptimizer


@runtime_checkable
class Stepper(Protocol):
    """The optimizer part of a ZeRO strategy: where the fp32 masters and the optimizer state live
    and how they step. The stage calls these at fixed points of the step; ``ShardedStepper`` (on
    the device) and ``offload.OffloadStepper`` (host RAM / NVMe) implement all of them."""

    #: the strategy's name with this part (None: the stage's own)
    name: str | None
    #: whether the stage's memory formula holds with this part
    formula: bool
    #: where masters and optimizer state live (``offload.OffloadPolicy``; None: with the working params)
    policy: Any

    # set-up
    def check_stage(self, stage: int, /) -> None:
        """Raise ValueError if this part cannot serve ZeRO stage ``stage`` (at construction)."""

    def check(self, stage: int, device: torch.device, optimizer: torch.optim.Optimizer,
              precision: Any = None, /) -> None:
        """Raise before anything is laid out if the optimizer, device or precision cannot be served."""

    def build_chunks(self, rank: int, /) -> Any:
        """Where ZeRO-3's partitioned build keeps this rank's chunks (None: RAM)."""

    def place_unit(self, unit: Any, rank: int, /) -> None:
        """ZeRO-3: a unit was built; move its shards where this part keeps them."""

    def page_units(self, order: Sequence[tuple[Any, int]], /) -> None:
        """ZeRO-3: the units in the masters' order, for a part that pages their shards."""

    def setup(self, sharded: ShardedOptimizer, slots: Callable[[], tuple[list, list]], device: torch.device,
              rank: int, masters_external: bool, on_reduced: Callable[[Callable], None],
              is_sync: Callable[[], bool], /) -> Any:
        """After the stage laid out its masters: returns what steps from now on."""

    # pieces of the step
    def gradients(self, partitions: list[torch.Tensor], sharded: Any, /) -> list[torch.Tensor]:
        """The gradients the step reads, from this rank's reduced partitions."""

    def norm_reader(self, grads: list[torch.Tensor], /) -> Any:
        """How the per-parameter gradient norms read ranges of ``grads``."""

    def norm_factor(self) -> float:
        """What the gradients' norm is multiplied by (a clip coefficient not applied yet)."""

    def scale(self, grads: list[torch.Tensor], coef: torch.Tensor, /) -> None:
        """Clip by norm: multiply the gradients by ``coef`` (or remember it for the step)."""

    def clamp(self, grads: list[torch.Tensor], value: float, loss_scale: float, /) -> None:
        """Clip by value, element-wise."""

    def step(self, sharded: Any, loss_scale: float, /) -> None:
        """The inner step on the masters."""

    def zero(self, sharded: Any, /) -> None:
        """Forget this step's gradients."""

    def zero_grads(self, slots: list[int] | None, /) -> None:
        """Zero the gradients this part holds itself, of master slots ``slots`` (None: all)."""

    def before_refresh(self, sharded: Any, /) -> None:
        """Before the working parameters are refreshed from the masters."""

    def took_working(self) -> bool:
        """ZeRO-3: did the last step write the working shards already?"""

    def updated(self, sharded: Any, working: list[torch.Tensor], /) -> list[torch.Tensor]:
        """What stages 1/2 all-gather after a step."""

    def exposed_state(self, sharded: Any, /) -> contextlib.AbstractContextManager:
        """Context in which ``sharded``'s optimizer state is readable (a checkpoint save)."""

    # memory, reports, end
    def adjust_memory(self, out: dict[str, list[torch.Tensor]], sharded: Any, /) -> None:
        """Correct the memory report's categories for where this part keeps things."""

    def report(self, sharded: Any, stage: int, /) -> dict[str, Any]:
        """Where the optimizer state is and how it moves (logs, tests)."""

    def log_setup(self, sharded: Any, stage: int, /) -> None:
        """Log the set-up (rank 0)."""

    def teardown(self) -> None:
        """Release files, threads and buffers."""


class ShardedStepper:
    """The default :class:`Stepper`: the user's optimizer on this rank's fp32 master slices, on
    the working device."""

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
        """This rank's reduced gradient slices in the masters' dtype (the partitions themselves
        when already in it, else copies), attached to the master slices."""
        if self._grads is None:
            self._grads = [g if g.dtype == m.dtype else g.to(m.dtype) for g, m in zip(partitions, sharded.masters)]
            sharded.set_grads(self._grads)
        return self._grads

    def norm_reader(self, grads: list[torch.Tensor]) -> Reader:
        """How the per-parameter gradient norms read ranges of the gradient slots ``grads``."""
        return slice_reader(grads)

    def norm_factor(self) -> float:
        """What the gradients' norm is multiplied by (a clip coefficient not applied to them yet)."""
        return 1.0

    def scale(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        for g in grads:  # a 16-bit slice (16-bit masters) times the fp32 coefficient, rounded once
            g.detach().mul_(coef if coef.dim() == 0 else coef.to(g.dtype))

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
