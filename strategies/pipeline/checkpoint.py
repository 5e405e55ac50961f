"""The pipeline's checkpoint adapter (``strategies/checkpoint.py``): every tensor under the name the
non-pipelined model gives it (``PipelineModule.plain_key``), a tied parameter once, from its lowest
owning stage, under its first name (``canonical_key``); under ZeRO-1 each replica's partition
pieces (``zero1.StageZero1``). So a pipeline checkpoint resumes under any other strategy and theirs
here. With ``tensor_parallel`` the strategy's adapter is ``TensorAxis(PipelineCheckpoint)``
(``parallel/tensor_checkpoint.py``): each stage's tensor-parallel parameters and their optimizer
state are saved whole (joined over the stage's tensor group) and loaded cut, so pp x tp resumes
under another mesh (pp alone, single, zero, dp x tp) and the other way.

Reads the strategy's ``module``, ``optimizer``, ``pipe``, ``replica``, ``_pipe_prefix`` and
``_zero``; never imports ``strategy.py``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import ParamShard, ReplicatedCheckpoint, ShardReader
from ..parallel.tensor_plan import gather_full_state


def _read_parameter(reader: ShardReader, key: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copy the saved ``key`` into ``p``; returns its optimizer state (per-element and 0-dim)."""
    n = p.numel()
    p.copy_(reader.read(key, "param", 0, n).view(p.shape))
    loaded = {kind: reader.read(key, kind, 0, n).view(p.shape) for kind in reader.kinds(key) if kind != "param"}
    loaded.update(reader.scalars(key))
    return loaded


class PipelineCheckpoint(ReplicatedCheckpoint):
    """This stage's part of the checkpoint, in the non-pipelined model's names."""

    #: ``full_state_dict`` gathers the tensor-parallel shards whole itself (``TensorAxis`` keeps it)
    joins_tensor_shards = True

    def writes_shard(self) -> bool:
        """Replica 0 of every stage; under ZeRO-1 every replica (each holds a partition)."""
        s = self.s
        return s.replica == 0 or s._zero is not None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every stage's layers, under the non-pipelined model's names, on global rank 0
        (tensor-parallel shards gathered whole over their stage's tensor group first)."""
        s = self.s
        assert s.module is not None
        local = {k: v.detach().to("cpu", copy=True) for k, v in s.module.state_dict().items()}
        mine = {self.plain(k): v for k, v in gather_full_state(s, local).items()}
        if not s.distributed:
            return mine
        parts = [None] * s.world_size if s.is_global_zero else None
        dist.gather_object(mine if s.replica == 0 and s.mesh_rank("tensor") == 0 else None, parts, dst=0)
        if not s.is_global_zero:
            return {}
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part or {})
        return full

    def in_pipe(self, key: str) -> str | None:
        """``key`` relative to the PipelineModule, or None for one of the TrainModule's own."""
        s = self.s
        prefix = s._pipe_prefix
        return key[len(prefix):] if s.pipe is not None and key.startswith(prefix) else None

    def plain(self, key: str) -> str:
        """This stage's module key -> the non-pipelined model's."""
        s = self.s
        inner = self.in_pipe(key)
        return key if inner is None else s._pipe_prefix + s.pipe.plain_key(inner)

    def canonical(self, name: str) -> str:
        """The plain name a (possibly tied) parameter is saved under: its first one."""
        s = self.s
        inner = self.in_pipe(name)
        return name if inner is None else s._pipe_prefix + s.pipe.canonical_key(inner)

    def saves(self, name: str) -> bool:
        """Whether this stage saves ``name`` (a tied parameter: its lowest owning stage only)."""
        s = self.s
        inner = self.in_pipe(name)
        return inner is None or s.pipe.saves_key(inner)

    def checkpoint_model_info(self) -> dict[str, Any]:
        """The base's description in plain names: tied parameters under their first name, their
        other names (on any stage) as aliases of it."""
        s = self.s
        info = super().checkpoint_model_info()
        trainable = self.trainable_names()
        aliases = {self.plain(n): self.canonical(n)
                   for n, p in s.module.named_parameters(remove_duplicate=False)
                   if id(p) in trainable and self.plain(n) != self.canonical(n)}
        return {"params": {self.canonical(n): v for n, v in info["params"].items()}, "aliases": aliases,
                "extras": {self.plain(k): v for k, v in info["extras"].items()},
                "keys": [self.plain(k) for k in info["keys"]]}

    def optimizer_group_names(self) -> list[list[str]]:
        """Each param group's parameters by checkpoint name; under ZeRO-1 the user's optimizer
        holds master slices, so the groups are the flat buffers' parameters."""
        s = self.s
        if s._zero is None:
            return [[self.canonical(n) for n in group] for group in super().optimizer_group_names()]
        names = self.checkpoint_names()
        return [[names[id(p)] for p in fg.params if id(p) in names] for fg in s._zero.flat_groups]

    def checkpoint_names(self) -> dict[int, str]:
        """``id(parameter) -> the plain name it is checkpointed under`` (``canonical``)."""
        return {i: self.canonical(n) for i, n in self.trainable_names().items()}

    def param_shards(self) -> dict[str, ParamShard]:
        """This stage's shards in plain names: whole parameters (replica 0), or under ZeRO-1 each
        replica's partition pieces; a tied parameter only from its lowest owning stage (the other
        owners' copies, masters and optimizer state are equal to it)."""
        s = self.s
        if s._zero is None:
            shards = super().param_shards()
        else:
            shards = s._zero.param_shards(self.trainable_names())
        return {self.canonical(n): sh for n, sh in shards.items() if self.saves(n)}

    def extra_state(self) -> dict[str, torch.Tensor]:
        """The buffers (and frozen parameters) in plain names, from replica 0 only (under ZeRO-1
        every replica writes its partitions, the extras once)."""
        s = self.s
        assert s.module is not None
        if s.replica != 0:
            return {}
        extras = super().checkpoint_model_info()["extras"]  # this stage's own keys
        return {self.plain(k): v.detach() for k, v in s.module.state_dict().items() if k in extras}

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: this stage's buffers, parameters (a tied one from its single saved copy)
        and optimizer state, each read under its plain name; under ZeRO-1 this replica's partition
        of the masters and state, then the working parameters gathered from every replica."""
        s = self.s
        assert s.module is not None and s.optimizer is not None
        names = self.checkpoint_names()
        with torch.no_grad():
            extras = super().checkpoint_model_info()["extras"]
            s.module.load_state_dict({k: reader.extra(self.plain(k)) for k in extras}, strict=False)
        if s._zero is not None:
            s._zero.load_param_shards(names, reader)
            return
        order = [p for g in s.optimizer.param_groups for p in g["params"]]
        slot = {id(p): i for i, p in enumerate(order)}
        state = {}
        with torch.no_grad():
            for p in s.module.parameters():
                if id(p) in names:
                    loaded = _read_parameter(reader, names[id(p)], p)
                    if loaded and id(p) in slot:
                        state[slot[id(p)]] = loaded
        groups = reader.param_groups(s.optimizer.state_dict()["param_groups"])
        s.optimizer.load_state_dict({"state": state, "param_groups": groups})
