"""The Strategy interface: everything the Trainer needs from a way of distributing training.

The Trainer calls these methods in a fixed order and never asks which strategy it holds:

    connect(info, device, precision) -> setup_environment() -> configure_model(module)
    -> setup_module(module) -> setup_optimizer(optimizer)
    loop: training_step -> backward [under no_sync() while accumulating] -> optimizer_step
    state_dict / load_state_dict / full_state_dict -> teardown()

The defaults here implement a *replicated* strategy: every rank holds the whole model and whole
optimizer, and gradients are already identical on every rank when ``optimizer_step`` runs. Single
process and DDP use them as they are; sharded strategies override the gradient, optimizer and
checkpoint methods.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .environment import ProcessInfo, init_process_group
from .precision import Precision


class StepWrapper(nn.Module):
    """Routes ``forward`` to the TrainModule's step methods, so that wrappers which act on
    ``forward`` (DDP's gradient hooks, ZeRO-3's gather hooks) see the user's training step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, method)(*args, **kwargs)


class Strategy:
    name = "base"

    def __init__(self, process_group_timeout_s: float = 300.0) -> None:
        if process_group_timeout_s <= 0:
            raise ValueError(f"process_group_timeout_s={process_group_timeout_s!r} must be > 0")
        self.process_group_timeout_s = float(process_group_timeout_s)
        self.info = ProcessInfo()
        self.device = torch.device("cpu")
        self.precision = Precision()
        self.module: nn.Module | None = None  # the user's TrainModule, unwrapped
        self.model: nn.Module | None = None  # what the step runs through (may wrap self.module)
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ environment
    def connect(self, info: ProcessInfo, device: torch.device, precision: Precision) -> None:
        self.info, self.device, self.precision = info, device, precision

    def setup_environment(self) -> None:
        init_process_group(self.info, self.device, self.process_group_timeout_s)

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

    # ------------------------------------------------------------------ model and optimizer
    def configure_model(self, module: nn.Module) -> None:
        """Let the module build its layers (``TrainModule.configure_model``)."""
        module.configure_model()

    def setup_module(self, module: nn.Module) -> None:
        module = self.precision.convert_module(module).to(self.device)
        self.module = module
        self.model = StepWrapper(module)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def parameters_for_optimizer(self) -> Iterator[nn.Parameter]:
        assert self.module is not None
        return self.module.parameters()

    # ------------------------------------------------------------------ the step
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        with self.precision.forward_context(self.device.type):
            return self.model("training_step", batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        with self.precision.forward_context(self.device.type):
            return self.model("validation_step", batch, batch_idx)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.scale_loss(loss).backward()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for micro-batches that only accumulate gradients (no communication)."""
        return contextlib.nullcontext()

    def step_gradients(self) -> list[torch.Tensor]:
        """The gradient tensors this rank's optimizer steps on, after reduction."""
        assert self.module is not None
        return [p.grad for p in self.module.parameters() if p.grad is not None]

    def _local_grad_sq_norm(self) -> torch.Tensor:
        grads = self.step_gradients()
        if not grads:
            return torch.zeros((), device=self.device)
        return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip this rank's step gradients to a global L2 norm of ``max_norm``; returns the norm
        before clipping. Replicated strategies need no communication."""
        total = self._local_grad_sq_norm().sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in self.step_gradients():
            g.detach().mul_(coef.to(g.dtype))
        return total

    def optimizer_step(self, gradient_clip_val: float | None = None) -> bool:
        """Unscale, skip on overflow (every rank together), clip, step, zero the gradients.
        Returns whether the optimizer stepped."""
        assert self.optimizer is not None
        overflow = self.precision.unscale_and_check(self.step_gradients(), self.any_rank)
        self.precision.update(overflow)
        if not overflow:
            if gradient_clip_val:
                self.clip_grad_norm_(gradient_clip_val)
            self.optimizer.step()
        self.zero_grad()
        return not overflow

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ collectives
    def reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Sum or mean over ranks (SUM then divide: ReduceOp.AVG is unreliable on gloo)."""
        if op not in ("mean", "sum", "max"):
            raise ValueError(f"reduce op={op!r}; valid choices: mean, sum, max")
        t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None)
        t = t.detach().clone().to(self.device)
        if self.distributed:
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
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_shard_rank(self) -> int:
        """Which rank's shard file this rank loads (replicated: rank 0's; sharded: its own)."""
        return 0

    def writes_shard(self) -> bool:
        return self.is_global_zero

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: model and optimizer state it alone must save."""
        assert self.module is not None and self.optimizer is not None
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None and self.optimizer is not None
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state.get("precision", {}))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 model state on global rank 0, ``{}`` elsewhere."""
        assert self.module is not None
        if not self.is_global_zero:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    # ------------------------------------------------------------------ end
    def teardown(self) -> None:
        self.model = None

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds per category (working params, grads, master, optimizer state)."""
        from .memory import count_bytes
        return count_bytes(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"

