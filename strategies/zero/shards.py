"""Partitioned optimizer state <-> the checkpoint's per-parameter shards, as functions of the
flat groups, the sharded optimizer and a rank in the partitioning group.

Every owner of ZeRO partitions saves and loads through these: the ZeRO strategies (rank = global
rank, the world partitions) and the pipeline's ZeRO-1 (rank = the replica, each stage's
data-parallel group partitions). The format is the Trainer's strategy-neutral one
(``base.ParamShard``): per canonical parameter name, the element range this rank holds.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..base import ParamShard, ShardReader, split_optimizer_state
from .flat_buffer import FlatParamGroup


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
        for pc in fg.layout.pieces(rank):
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
        lo, hi = fg.layout.partition_range(rank)
        group = [names[id(p)] for p in fg.params]
        kinds = sorted({k for n in group for k in reader.kinds(n)} - {"param"})
        master = torch.zeros(hi - lo, dtype=torch.float32)
        per = {k: torch.zeros(hi - lo, dtype=torch.float32) for k in kinds}
        mine = fg.layout.pieces(rank)
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
