"""Checkpoints of tensor-parallel parameters in the one reshardable format (issue 45).

The format (``strategies/checkpoint.py``: ``ParamShard``) holds every parameter under its full
(un-split) name and shape: its fp32 values and each per-element optimizer state as element ranges
of the flattened whole parameter. A rank of a tensor group holds a shard of it (``TensorShard``: a
cut along one dimension, of packed blocks), which is not one range of the whole (a row-wise or a
packed q/k/v cut is strided), so the family's adapter (``ReplicatedCheckpoint``, ``ZeroCheckpoint``)
is wrapped:

* saving (collective): each tensor-parallel parameter's pieces in this rank's hands (a ZeRO
  partition's, or the whole local shard on the first replica) are summed over the replica group
  into the local shard (disjoint pieces and zeros: exact), joined over the tensor group
  (``full_tensor``), and every rank holding the parameter writes an equal contiguous range of the
  whole, one parameter and one kind at a time. Replicated parameters and extras (equal on every
  tensor rank) are written by tensor index 0's ranks only.
* loading: the adapter reads through ``TensorShardReader``, which answers in local coordinates:
  the whole tensor read, this rank's shard cut from it (``TensorShard.cut``), the range taken.

So a checkpoint saved under dp x tp resumes under any strategy on any mesh (zero3 or single with
tp=1 included), and one saved by any of them resumes under dp x tp. ``TensorAxis(Adapter)`` is the
``checkpoint_adapter`` of the strategies that take a tensor axis (DDP, ZeRO-1/2/3, the pipeline:
each stage's shards joined over its tensor group, summed over its replicas, under the
non-pipelined model's names).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import ParamShard, ShardReader
from .tensor import full_tensor
from .tensor_plan import gather_full_state, is_cut


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The whole parameter's shape of a tensor-parallel shard."""
    shard = param.tensor_parallel
    shape = list(param.shape)
    shape[shard.dim] *= shard.size
    return tuple(shape)


class TensorAxis:
    """A strategy's ``checkpoint_adapter``: ``adapter(strategy)``, wrapped in a
    :class:`TensorParallelCheckpoint` where the strategy has a tensor axis or its module holds
    tensor-parallel parameters."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def __call__(self, strategy: Any) -> Any:
        inner = self.adapter(strategy)
        if strategy.module is None or (strategy.mesh_size("tensor") == 1 and not is_cut(strategy.module)):
            return inner
        return TensorParallelCheckpoint(inner)  # a tensor axis (a module with no plan: only tensor rank 0 saves)

    def __repr__(self) -> str:
        return f"TensorAxis({self.adapter.__name__})"


class TensorShardReader:
    """A ``ShardReader`` in local coordinates: a tensor-parallel parameter's elements are those of
    this rank's shard, cut from the whole one the checkpoint holds; everything else as saved."""

    def __init__(self, reader: ShardReader, sharded: dict[str, nn.Parameter]) -> None:
        self.reader, self.sharded = reader, sharded

    def __getattr__(self, name: str) -> Any:  # names, kinds, scalars, extra, param_groups
        return getattr(self.reader, name)

    def read(self, name: str, kind: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        p = self.sharded.get(name)
        if p is None:
            return self.reader.read(name, kind, start, end, out=out)
        shape = full_shape(p)
        whole = self.reader.read(name, kind, 0, math.prod(shape)).view(shape)
        local = p.tensor_parallel.cut(whole).reshape(-1)[start:end]
        return local if out is None else out.copy_(local)


class TensorParallelCheckpoint:
    """The family's adapter (``inner``) with its tensor-parallel parameters saved whole and loaded
    cut (the module's docstring); what it does not change is the inner adapter's."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.s = inner, inner.s

    def __getattr__(self, name: str) -> Any:  # trainable_names, optimizer_group_names, extra_names, ...
        return getattr(self.inner, name)

    def sharded(self, saving: bool = False) -> dict[str, nn.Parameter]:
        """The tensor-parallel trainable parameters by the names the checkpoint holds them under
        (``checkpoint_names``: a pipeline stage's are the non-pipelined model's), in module order;
        ``saving``: only those the inner adapter ``saves`` here (not a pipeline's tied copy on a
        stage other than its lowest owning one)."""
        names = self.inner.checkpoint_names()
        return {names[id(p)]: p for n, p in self.s.module.named_parameters()
                if id(p) in names and hasattr(p, "tensor_parallel") and (not saving or self.inner.saves(n))}

    def _refuse_without_axis(self) -> None:
        if self.s.mesh_group("tensor") is None:  # cut by hand: no tensor group to join the shards over
            raise NotImplementedError(f"{self.s.name}: checkpoints of tensor-parallel parameters cut without the "
                                      "strategy's tensor axis (tensor_parallel=1) are not built; valid: "
                                      "tensor_parallel=n on the strategy, which cuts the module by its plan itself")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the inner adapter's, each tensor-parallel parameter gathered whole from the
        module (an adapter whose ``joins_tensor_shards`` says it joins them itself, from its fp32
        masters: ZeRO-3's, whose module holds placeholders, as it is)."""
        if getattr(self.inner, "joins_tensor_shards", False):
            return self.inner.full_state_dict()
        return gather_full_state(self.s, self.inner.full_state_dict())

    def writes_shard(self) -> bool:
        return True  # every rank holding a tensor-parallel parameter writes a range of it

    def checkpoint_model_info(self) -> dict[str, Any]:
        """The inner adapter's, tensor-parallel parameters with their whole shapes."""
        info = self.inner.checkpoint_model_info()
        for name, p in self.sharded().items():
            info["params"][name] = (full_shape(p), p.dtype)
        return info

    def extra_state(self) -> dict[str, torch.Tensor]:
        return self.inner.extra_state() if self.s.mesh_rank("tensor") == 0 else {}

    def param_shards(self) -> dict[str, ParamShard]:
        """Collective: replicated parameters as the inner adapter saves them (tensor index 0's
        ranks), each tensor-parallel one whole, an equal range of it per rank holding it (its
        replicas x its tensor group: a pipeline's are its stage's)."""
        self._refuse_without_axis()
        s, shards, sharded = self.s, self.inner.param_shards(), self.sharded(saving=True)
        tensor_rank = s.mesh_rank("tensor")
        out = {n: sh for n, sh in shards.items() if n not in sharded and tensor_rank == 0}
        described = self._describe({n: shards[n] for n in sharded if n in shards})
        holders = s.mesh_size("tensor") * s.replica_world_size
        me = tensor_rank * s.replica_world_size + s.replica_rank
        for n, p in sharded.items():
            kinds, scalars = described.get(n, (["param"], {}))
            numel = math.prod(full_shape(p))
            start, end = numel * me // holders, numel * (me + 1) // holders
            tensors = {k: self._whole(p, shards.get(n), k)[start:end].clone() for k in kinds}
            if end > start:
                out[n] = ParamShard(start, end, tensors, scalars)
        return out

    def _describe(self, mine: dict[str, ParamShard]) -> dict[str, tuple[list[str], dict[str, torch.Tensor]]]:
        """Collective: each tensor-parallel parameter's per-element kinds and scalars (Adam's step)
        as the ranks holding a piece of it know them, so that every rank holding it writes them."""
        local = {n: (sorted(sh.tensors), {k: v.detach().cpu() for k, v in sh.scalars.items()})
                 for n, sh in mine.items()}
        everyone = [local]
        if self.s.distributed:
            everyone = [None] * self.s.world_size
            dist.all_gather_object(everyone, local)
        out: dict[str, tuple[list[str], dict[str, torch.Tensor]]] = {}
        for seen in everyone:
            for n, (kinds, scalars) in seen.items():
                known, numbers = out.get(n, ([], {}))
                out[n] = (sorted(set(known) | set(kinds)), numbers or scalars)
        return out

    def _whole(self, p: nn.Parameter, piece: ParamShard | None, kind: str) -> torch.Tensor:
        """Collective over the replica and tensor groups: ``kind`` of the whole parameter, flat."""
        local = torch.zeros(p.numel(), dtype=torch.float32, device=self.s.device)
        if piece is not None and kind in piece.tensors:
            local[piece.start:piece.end].copy_(piece.tensors[kind].reshape(-1))
        if self.s.replica_world_size > 1:
            dist.all_reduce(local, group=self.s.replica_group)
        return full_tensor((p, local.view(p.shape)), self.s.mesh_group("tensor")).reshape(-1)

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: the inner adapter's load, reading each tensor-parallel parameter's shard
        cut from the whole one saved."""
        self._refuse_without_axis()
        self.inner.load_param_shards(TensorShardReader(reader, self.sharded()))
