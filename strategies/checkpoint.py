"""The strategy-neutral checkpoint format, and the replicated family's side of it.

Every strategy saves and loads through one adapter of its family (``Strategy.checkpointer``; the
Strategy's checkpoint methods forward to it): ``ReplicatedCheckpoint`` here (single process, DDP:
every rank holds the whole model), ``zero.shards.ZeroCheckpoint`` (ZeRO-1/2: flat partitions),
``zero.stage3.checkpoint.Stage3Checkpoint`` (ZeRO-3: unit partitions) and
``pipeline.checkpoint.PipelineCheckpoint`` (stages, names of the non-pipelined model). A save
writes every rank's ``param_shards()`` and ``extra_state()`` (described by
``checkpoint_model_info()`` and ``optimizer_group_names()``); a load calls
``load_param_shards(reader)``, which fills this rank's part from any strategy's checkpoint on any
world size (``trainer/checkpoint/reshard.py`` is the reader). ``full_state_dict()`` exports the complete
weights.

An adapter reads its strategy (``CheckpointOwner``: the module, the optimizer, the rank) and never
imports the strategy's module, so no strategy and its adapter import each other.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .optimizers import param_states, split_kind, state_slots


class ParamShard(NamedTuple):
    """The part of one (canonically named) parameter a rank saves: elements ``[start, end)`` of the
    flattened full parameter, as 1-D tensors of ``end - start`` elements under ``tensors`` (the fp32
    weights as ``"param"``, and each per-element optimizer state such as ``"exp_avg"``), and the
    optimizer's 0-dim state (``"step"``) under ``scalars``."""

    start: int
    end: int
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor]


class ShardReader(Protocol):
    """What ``load_param_shards`` reads a checkpoint through (``trainer/checkpoint/reshard.py`` implements
    it): any element range of any saved parameter, whichever files hold it."""

    def names(self) -> list[str]:
        """The canonical names of the saved trainable parameters."""

    def kinds(self, name: str) -> list[str]:
        """Per-element tensors saved for ``name``: ``"param"`` and optimizer state kinds."""

    def read(self, name: str, kind: str, start: int, end: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened ``kind`` of ``name`` (1-D, fp32 unless
        ``out`` is given)."""

    def scalars(self, name: str) -> dict[str, torch.Tensor]: ...

    def extra(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter, whole."""

    def param_groups(self, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``current`` (an ``optimizer.state_dict()["param_groups"]``) with the saved
        hyperparameters."""


def split_optimizer_state(owner: str, like: torch.Tensor, state: dict[str, Any]
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split one tensor's optimizer state into per-element tensors (same shape as ``like``, given
    flattened and fp32) and 0-dim scalars. Anything else (Adafactor's factored moments, python
    objects) cannot be sharded by element: the error names it."""
    per, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = torch.tensor(float(value), dtype=torch.float64)
        if not torch.is_tensor(value):
            raise ValueError(f"optimizer state {key!r} of {owner} is a {type(value).__name__}: the "
                             "checkpoint format holds per-element tensors and scalars only")
        if value.shape == like.shape and not (key == "step" and value.dim() == 0):
            per[key] = value.detach().reshape(-1).float()
        elif value.numel() == 1 and value.dim() == 0:
            scalars[key] = value.detach().to("cpu")
        else:
            raise ValueError(
                f"optimizer state {key!r} of {owner} has shape {tuple(value.shape)}, neither the "
                f"parameter's {tuple(like.shape)} nor a scalar: an optimizer that keeps non-element-wise "
                "state cannot be checkpointed by parameter shards")
    return per, scalars


class CheckpointOwner(Protocol):
    """What a checkpoint adapter reads of its strategy (each family's adapter reads more of its own)."""

    module: nn.Module | None
    optimizer: Any

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def replica_rank(self) -> int: ...


class ReplicatedCheckpoint:
    """The replicated strategies' checkpoints: the ranks that ``writes_shard()`` hold every full
    range of their module. The base of the other families' adapters."""

    def __init__(self, strategy: CheckpointOwner) -> None:
        self.s = strategy

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 model state on global rank 0, ``{}`` elsewhere."""
        assert self.s.module is not None
        self.refuse_local_experts("a full state dict")
        if not self.s.is_global_zero:
            return {}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.s.module.state_dict().items()}

    def writes_shard(self) -> bool:
        """Whether this rank's ``param_shards``/``extra_state`` hold anything: here the first of
        its replicas (rank 0 without a tensor axis). Each family's adapter answers for itself (a
        tensor axis: ``parallel/tensor_checkpoint.py``, every rank; DTensors: global rank 0)."""
        return self.s.replica_rank == 0

    def globally_named_experts(self) -> set[str]:
        """Local names of the expert parameters (moe/, ``ep_size`` > 1) this adapter saves under
        their global expert index. None here: rank 0 would save only its own experts, under names
        every expert-parallel place uses for other experts."""
        return set()

    def refuse_local_experts(self, what: str) -> None:
        """Refuse (the same on every rank, before any collective) a save or load that would mix up
        expert-parallel parameters this adapter does not name globally."""
        assert self.s.module is not None
        covered = self.globally_named_experts()
        for n, p in self.s.module.named_parameters():
            kind = getattr(p, "group_name", "ep_size_1") if getattr(p, "allreduce", True) is False else "ep_size_1"
            if kind != "ep_size_1" and n not in covered:
                raise NotImplementedError(
                    f"{self.s.name}: {what} of expert-parallel parameter {n!r} ({kind}) is not built for this "
                    "strategy (each expert-parallel rank holds other experts under that name); valid: zero1 or "
                    "zero2 with zerotrain.moe.MoE experts (saved under their global index), or ep_size=1")

    def trainable_names(self) -> dict[int, str]:
        """``id(parameter) -> canonical name`` (its first name) for the trainable parameters."""
        assert self.s.module is not None
        return {id(p): n for n, p in self.s.module.named_parameters() if p.requires_grad}

    def checkpoint_names(self) -> dict[int, str]:
        """``id(parameter) -> the name the checkpoint holds it under``: here its canonical name (the
        pipeline's: the non-pipelined model's)."""
        return self.trainable_names()

    def saves(self, name: str) -> bool:
        """Whether this rank's shards hold module parameter ``name`` when it writes (every one here;
        a pipeline stage: not a tied copy whose lowest owning stage is another)."""
        return True

    def checkpoint_model_info(self) -> dict[str, Any]:
        """What this rank's model needs from a checkpoint: trainable parameters by canonical name
        ``{name: (shape, dtype)}``, their other names (``aliases``: tied parameters), the other
        state-dict entries (``extras``: buffers, frozen parameters) and the state-dict keys in order."""
        assert self.s.module is not None
        names = self.trainable_names()
        params = {n: (tuple(p.shape), p.dtype) for n, p in self.s.module.named_parameters()
                  if names.get(id(p)) == n}
        aliases = {n: names[id(p)] for n, p in self.s.module.named_parameters(remove_duplicate=False)
                   if id(p) in names and names[id(p)] != n}
        sd = self.s.module.state_dict()
        extras = {k: (tuple(v.shape), v.dtype) for k, v in sd.items() if k not in params and k not in aliases}
        return {"params": params, "aliases": aliases, "extras": extras, "keys": list(sd)}

    def optimizer_group_names(self) -> list[list[str]]:
        """The canonical names of the trainable parameters in each optimizer param group."""
        assert self.s.optimizer is not None
        names = self.trainable_names()
        return [[names[id(p)] for p in g["params"] if id(p) in names] for g in self.s.optimizer.param_groups]

    def param_shards(self) -> dict[str, ParamShard]:
        """This rank's part of every trainable parameter, with its optimizer state."""
        assert self.s.module is not None and self.s.optimizer is not None
        self.refuse_local_experts("a checkpoint")
        if not self.writes_shard():
            return {}
        names = self.trainable_names()
        out = {}
        for n, p in self.s.module.named_parameters():
            if names.get(id(p)) != n:
                continue
            per, scalars = {}, {}
            for suffix, st in param_states(self.s.optimizer, p):  # several: each optimizer's (optimizers.py)
                tensors, numbers = split_optimizer_state(f"parameter {n!r}", p, st)
                per.update({k + suffix: v for k, v in tensors.items()})
                scalars.update({k + suffix: v for k, v in numbers.items()})
            out[n] = ParamShard(0, p.numel(), {"param": p.detach().reshape(-1).float(), **per}, scalars)
        return out

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The state-dict entries that are not trainable parameters, from the ranks that save."""
        assert self.s.module is not None
        if not self.writes_shard():
            return {}
        extras = self.checkpoint_model_info()["extras"]
        return {k: v.detach() for k, v in self.s.module.state_dict().items() if k in extras}

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: fill this rank's parameters, optimizer state and extras from ``reader``.
        Replicated: every rank reads every full parameter of its module."""
        assert self.s.module is not None and self.s.optimizer is not None
        self.refuse_local_experts("a checkpoint load")
        names = self.trainable_names()
        slots = state_slots(self.s.optimizer)  # each optimizer's state of p: its index and kind suffix
        state: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for n, p in self.s.module.named_parameters():
                if names.get(id(p)) != n:
                    continue
                flat = reader.read(n, "param", 0, p.numel())
                p.copy_(flat.view(p.shape))
                saved = {k: reader.read(n, k, 0, p.numel()).view(p.shape) for k in reader.kinds(n) if k != "param"}
                saved.update(reader.scalars(n))
                for i, suffix in slots.get(id(p), []):
                    st = {base: v for (base, sfx), v in ((split_kind(k), v) for k, v in saved.items()) if sfx == suffix}
                    if st:
                        state[i] = st
            info = self.checkpoint_model_info()
            self.s.module.load_state_dict({k: reader.extra(k) for k in info["extras"]}, strict=False)
        saved = self.s.optimizer.state_dict()
        self.s.optimizer.load_state_dict({"state": state, "param_groups": reader.param_groups(saved["param_groups"])})
