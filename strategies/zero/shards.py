"""ZeRO's checkpoints: partitioned optimizer state <-> the checkpoint's per-parameter shards, as
functions of the flat groups, the sharded optimizer and a rank in the partitioning group, and
``ZeroCheckpoint``, the ZeRO-1/2 family's checkpoint adapter (``strategies/checkpoint.py``; ZeRO-3's
extends it in ``stage3/checkpoint.py``).

Every owner of ZeRO partitions saves and loads through these: the ZeRO strategies (rank = global
rank, the world partitions) and the pipeline's ZeRO-1 (rank = the replica, each stage's
data-parallel group partitions). The format is the Trainer's strategy-neutral one
(``checkpoint.ParamShard``): per canonical parameter name, the element range this rank holds.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..checkpoint import ParamShard, ReplicatedCheckpoint, ShardReader, split_optimizer_state
from .comm.inflight import Work
from .experts import global_names, is_expert_group
from .flat_buffer import FlatParamGroup


def _rank_in(fg: FlatParamGroup, rank: int) -> int:
    """This rank's index in the group partitioning ``fg``: ``rank`` for the replicas', its own for an
    expert group's (``experts.py``: its expert-data-parallel group)."""
    return fg.rank if is_expert_group(fg.params) else rank


def partition_shards(flat_groups: Sequence[FlatParamGroup], sharded: Any, rank: int,
                     names: dict[int, str]) -> dict[str, ParamShard]:
    """Each parameter's intersection with ``rank``'s partition, from the fp32 masters and the
    optimizer state of that partition (padding excluded). ``names``: ``id(param) -> name``."""
    saved = sharded.state_dict()
    state = saved["optimizer"]["state"]
    out = {}
    for g, fg in enumerate(flat_groups):
        master = saved["master"][g].reshape(-1)
        per, scalars = split_optimizer_state(f"param group {g}", master, state.get(g, {}))
        for pc in fg.layout.pieces(_rank_in(fg, rank)):
            cut = slice(pc.partition_start, pc.partition_start + pc.numel)
            out[names[id(fg.params[pc.index])]] = ParamShard(
                pc.param_start, pc.param_start + pc.numel,
                {"param": master[cut], **{k: v[cut] for k, v in per.items()}}, scalars)
    return out


def load_partitions(flat_groups: Sequence[FlatParamGroup], sharded: Any, optimizer: torch.optim.Optimizer,
                    rank: int, names: dict[int, str], reader: ShardReader) -> None:
    """Rebuild ``rank``'s master slices and optimizer state from whatever ranges the checkpoint
    holds (any strategy, any world size). The working parameters are not touched: the caller
    gathers them afterwards."""
    masters, state = [], {}
    for g, fg in enumerate(flat_groups):
        lo, hi = fg.layout.partition_range(_rank_in(fg, rank))
        group = [names[id(p)] for p in fg.params]
        kinds = sorted({k for n in group for k in reader.kinds(n)} - {"param"})
        master = torch.zeros(hi - lo, dtype=torch.float32)
        per = {k: torch.zeros(hi - lo, dtype=torch.float32) for k in kinds}
        mine = fg.layout.pieces(_rank_in(fg, rank))
        for pc in mine:
            n, cut = group[pc.index], slice(pc.partition_start, pc.partition_start + pc.numel)
            reader.read(n, "param", pc.param_start, pc.param_start + pc.numel, out=master[cut])
            for k in kinds:
                if k in reader.kinds(n):  # else zeros: that parameter had no such state yet
                    reader.read(n, k, pc.param_start, pc.param_start + pc.numel, out=per[k][cut])
        # a group steps as one tensor: its scalars (Adam's step) come from its first parameter
        first = [group[pc.index] for pc in mine] + [n for n in group if n in reader.names()]
        scalars = reader.scalars(first[0]) if first else {}
        if per or scalars:
            state[g] = {**per, **scalars}
        masters.append(master)
    current = optimizer.state_dict()["param_groups"]
    sharded.load_state_dict({"master": masters, "optimizer": {
        "state": state, "param_groups": reader.param_groups(current)}})


class ZeroCheckpoint(ReplicatedCheckpoint):
    """ZeRO-1/2's checkpoints: each rank saves its partition of the fp32 masters and optimizer
    state; the extras (buffers, frozen parameters) are replicated and saved by rank 0. Reads the
    strategy's ``flat_groups``, ``sharded``, ``queue`` and ``group``."""

    def trainable_names(self) -> dict[int, str]:
        """Expert parameters (ep_size > 1) under their global expert index (``experts.global_names``),
        so any ``ep_size`` reads them back; the others as the base names them."""
        names = super().trainable_names()
        if not getattr(self.s, "holds_experts", False):
            return names
        renamed = global_names(self.s.module)
        return {i: renamed.get(n, n) for i, n in names.items()}

    def checkpoint_model_info(self) -> dict[str, Any]:
        info = super().checkpoint_model_info()
        if not getattr(self.s, "holds_experts", False):
            return info
        renamed = global_names(self.s.module)
        for local, p in self.s.module.named_parameters():  # the base took their local names for aliases
            if local in renamed:
                info["aliases"].pop(local, None)
                info["params"][renamed[local]] = (tuple(p.shape), p.dtype)
        info["keys"] = [renamed.get(k, k) for k in info["keys"]]
        return info

    def _refuse_experts(self, what: str) -> None:
        """The full state dict of expert-parallel parameters (every place's experts gathered on
        rank 0) is not built: refused (checkpoints save them under their global index)."""
        if getattr(self.s, "holds_experts", False):
            raise NotImplementedError(f"{self.s.name}: {what} of a model with expert-parallel parameters (moe/, "
                                      "ep_size > 1) is not built yet (issue 46: every place's experts gathered); "
                                      "valid: a checkpoint (its shards hold every expert under its global index), "
                                      "or ep_size=1")

    def extra_names(self) -> list[str]:
        """State-dict entries that are not trainable parameters: buffers and frozen parameters."""
        s = self.s
        assert s.module is not None
        trainable = {n for n, p in s.module.named_parameters(remove_duplicate=False) if p.requires_grad}
        return [k for k in s.module.state_dict() if k not in trainable]

    def finish_load(self, reader: ShardReader) -> None:
        """After ``load_param_shards`` filled masters and optimizer state: the extras from the
        checkpoint, then fresh working parameters and empty gradients."""
        s = self.s
        extras = self.extra_names()
        if extras:
            with torch.no_grad():
                s.module.load_state_dict({k: reader.extra(k) for k in extras}, strict=False)
        s._refresh_params()
        s.zero_grad()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 weights (from the masters) on rank 0 with the module's
        ``state_dict`` keys - tied parameters under each of their names, sharing one tensor as
        ``module.state_dict()`` does; ``{}`` elsewhere."""
        s = self.s
        assert s.sharded is not None and s.module is not None
        self._refuse_experts("a full state dict")
        s.queue.wait(Work.PARAMS)
        values: dict[int, torch.Tensor] = {}
        for i, fg in enumerate(s.flat_groups):
            full = s.sharded.gather_full(i, fg.layout, s.replica_rank, s.queue, s.group)
            if full is not None:
                # one tensor per parameter (not views of one buffer: writers such as
                # safetensors refuse tensors that share storage)
                full = full.to("cpu")
                values.update({id(p): fg.view(j, full).clone() for j, p in enumerate(fg.params)})
        return self.full_state_from(values)

    def full_state_from(self, values: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0: the module's ``state_dict`` keys, trainable parameters taken from ``values``
        (gathered fp32 tensors by parameter id; tied names share one), the rest copied to CPU.
        ``{}`` on the other ranks."""
        s = self.s
        if not s.is_global_zero:
            return {}
        by_name = dict(s.module.named_parameters(remove_duplicate=False))
        out = {}
        for k, v in s.module.state_dict().items():
            p = by_name.get(k)
            out[k] = values[id(p)] if p is not None and id(p) in values else v.detach().to("cpu", copy=True)
        return out

    def optimizer_group_names(self) -> list[list[str]]:
        names = self.trainable_names()
        return [[names[id(p)] for p in fg.params] for fg in self.s.flat_groups]

    def globally_named_experts(self) -> set[str]:
        """The experts of zerotrain.moe's layer (``experts.global_names``); Hugging Face's stacked
        expert tensors (moe/hf.py) are not renamed, so the base refuses to save them."""
        return set(global_names(self.s.module)) if getattr(self.s, "holds_experts", False) else set()

    def param_shards(self) -> dict[str, ParamShard]:
        """Each parameter's intersection with this rank's partition, from the fp32 masters and
        the optimizer state of that partition (padding excluded)."""
        s = self.s
        assert s.sharded is not None
        self.refuse_local_experts("a checkpoint")
        s.queue.wait(Work.PARAMS)
        return partition_shards(s.flat_groups, s.sharded, s.replica_rank, self.trainable_names())

    def extra_state(self) -> dict[str, torch.Tensor]:
        s = self.s
        s.queue.wait(Work.PARAMS)
        if not s.is_global_zero:
            return {}
        sd = s.module.state_dict()
        return {k: sd[k].detach() for k in self.extra_names()}

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: rebuild this rank's master slices and optimizer state from whatever
        ranges the checkpoint holds (any strategy, any world size), then all-gather the working
        parameters."""
        s = self.s
        assert s.sharded is not None and s.module is not None
        self.refuse_local_experts("a checkpoint load")
        s.queue.wait(Work.PARAMS)
        load_partitions(s.flat_groups, s.sharded, s.optimizer, s.replica_rank, self.trainable_names(), reader)
        self.finish_load(reader)
