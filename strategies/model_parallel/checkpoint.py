"""The checkpoints of ``ModelParallelStrategy``: zerotrain's one reshardable format, with every
DTensor saved whole.

A module parallelized by the user's own torch calls holds DTensors (``parallelize_module``'s
shards, ``fully_shard``'s FSDP2 shards, both on a 2-D mesh) under their ordinary names. A save
gathers each one (``full_tensor``: collective, every rank in the same order, one tensor at a time)
and global rank 0 writes it as a replicated strategy would, optimizer state included; a load reads
each whole tensor and keeps this rank's part of it (``distribute_tensor`` with the parameter's own
mesh and placements, cut locally: no communication). So a checkpoint of this strategy resumes under
any strategy (ddp, zero1-3, another mesh) and the other way, and ``full_state_dict`` is the plain
model's. The price: one whole parameter at a time on every rank, and rank 0 writes everything.
Lightning writes a torch distributed-checkpoint directory instead (its ``save_distributed_checkpoint``);
that layout is not read or written here.
"""
from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import ParamShard, ReplicatedCheckpoint, ShardReader, split_optimizer_state
from ..optimizers import param_states, split_kind, state_slots


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_value(t: Any) -> Any:
    """A DTensor whole on every rank (collective over its mesh); anything else as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t`` (a DTensor's local shard, sharing its storage), else ``t``."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def local_of(like: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``like``: for a DTensor, a DTensor of its mesh and placements holding
    this rank's part of ``full`` (cut here, nothing sent); otherwise ``full`` on ``like``'s device."""
    full = full.to(like.device, like.dtype)
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


class DTensorCheckpoint(ReplicatedCheckpoint):
    """Rank 0 writes every parameter whole; every rank takes part in the gathers."""

    def writes_shard(self) -> bool:
        """Global rank 0 only: it writes every DTensor whole (the first rank of each other tensor
        index is a first replica too, but writes nothing)."""
        return self.s.is_global_zero

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete model state on global rank 0 (each DTensor gathered), ``{}`` elsewhere."""
        assert self.s.module is not None
        self.refuse_local_experts("a full state dict")
        out = {}
        for k, v in self.s.module.state_dict().items():
            whole = full_value(v.detach())
            if self.s.is_global_zero:
                out[k] = whole.to("cpu", copy=True)
        return out

    def param_shards(self) -> dict[str, ParamShard]:
        """Collective: rank 0's shards are every trainable parameter whole, with its optimizer state
        (each DTensor gathered on every rank alike); ``{}`` on the other ranks."""
        assert self.s.module is not None and self.s.optimizer is not None
        self.refuse_local_experts("a checkpoint")
        names, out = self.trainable_names(), {}
        for n, p in self.s.module.named_parameters():
            if names.get(id(p)) != n:
                continue
            whole = full_value(p.detach())
            tensors: dict[str, torch.Tensor] = {"param": whole.reshape(-1).float()}
            scalars: dict[str, torch.Tensor] = {}
            for suffix, st in param_states(self.s.optimizer, p):
                gathered = {k: full_value(v) for k, v in st.items()}
                per, numbers = split_optimizer_state(f"parameter {n!r}", whole, gathered)
                tensors.update((k + suffix, v) for k, v in per.items())
                scalars.update((k + suffix, v) for k, v in numbers.items())
            if self.s.is_global_zero:
                out[n] = ParamShard(0, whole.numel(), tensors, scalars)
        return out

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Collective: the buffers and frozen parameters whole, on rank 0."""
        assert self.s.module is not None
        extras = self.checkpoint_model_info()["extras"]
        out = {}
        for k, v in self.s.module.state_dict().items():
            if k in extras:
                whole = full_value(v.detach())
                if self.s.is_global_zero:
                    out[k] = whole
        return out

    def load_param_shards(self, reader: ShardReader) -> None:
        """Every rank reads each saved tensor whole and keeps its part (no communication)."""
        assert self.s.module is not None and self.s.optimizer is not None
        self.refuse_local_experts("a checkpoint load")
        names, slots = self.trainable_names(), state_slots(self.s.optimizer)
        state: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for n, p in self.s.module.named_parameters():
                if names.get(id(p)) != n:
                    continue
                whole = reader.read(n, "param", 0, p.numel()).view(p.shape)
                local_tensor(p).copy_(local_tensor(local_of(p, whole)))
                kinds = [k for k in reader.kinds(n) if k != "param"]
                saved: dict[str, Any] = {k: local_of(p, reader.read(n, k, 0, p.numel()).view(p.shape)) for k in kinds}
                saved.update(reader.scalars(n))
                for i, suffix in slots.get(id(p), []):
                    mine = {split_kind(k)[0]: v for k, v in saved.items() if split_kind(k)[1] == suffix}
                    if mine:
                        state[i] = mine
            current = self.s.module.state_dict()
            extras = self.checkpoint_model_info()["extras"]
            self.s.module.load_state_dict({k: local_of(current[k], reader.extra(k)) for k in extras}, strict=False)
        held = self.s.optimizer.state_dict()
        self.s.optimizer.load_state_dict({"state": state, "param_groups": reader.param_groups(held["param_groups"])})
