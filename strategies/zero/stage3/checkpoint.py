"""ZeRO-3 in the strategy-neutral checkpoint format (``Strategy.param_shards`` /
``load_param_shards``, see ``strategies/base.py`` and ``trainer/checkpoint/reshard.py``).

Saving: each rank describes, for every trainable parameter with elements in its partition of some
unit, that element range of the full parameter with its fp32 master values and the optimizer state
over the same range (the optimizer steps on *runs* - maximal ranges of one unit partition in one
param group - so a parameter's state is a slice of its run's state). Loading: each rank asks the
reader for exactly the ranges of its partitions, whatever strategy and world size wrote them.

Frozen floating-point parameters live in the units too (sharded), but the format saves them whole
as extras: :meth:`extra_state` gathers the units that hold some to rank 0, so it is collective
when the model has frozen parameters; every rank must call it (as every rank writes its file).
"""
from __future__ import annotations

from typing import Any

import torch

from ...checkpoint import ParamShard, ShardReader, split_optimizer_state
from ...parallel.tensor_plan import join_shards
from ..shards import ZeroCheckpoint
from .experts import refuse_with_experts


class Stage3Checkpoint(ZeroCheckpoint):
    """ZeRO-3's checkpoint adapter: reads the strategy's ``units``, ``_runs`` (what the optimizer
    steps), ``_group_of``, ``plan``, ``sharded``, ``stepper`` and ``group``; never imports it."""

    #: ``full_state_dict`` joins tensor-parallel shards itself, from the masters (the module holds placeholders)
    joins_tensor_shards = True

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 weights on rank 0, gathered one unit at a time (no rank
        but rank 0 ever holds more than its shards); ``{}`` elsewhere. Tied parameters appear
        under each of their names as one tensor, as in ``module.state_dict()``."""
        s = self.s
        assert s.module is not None
        refuse_with_experts(s.units, "full_state_dict()", "strategy.gathered() on every rank, or ep_size=1")
        values: dict[int, torch.Tensor] = {}
        for u in s.units:
            full = u.gather_master(0, s.group)
            if full is not None:
                full = full.to("cpu")
                values.update({id(p): v.clone() for p, v in zip(u.params, u.param_views(full))})
                del full
        tensor = s.mesh_group("tensor")
        if tensor is not None and s.replica_rank == 0:  # this tensor group's ranks hold every unit's masters
            values = join_shards(s.module, values, tensor, s.device)
        return self.full_state_from(values)

    def _pieces_by_run(self):
        """``(unit, run, master view, [pieces of trainable params inside the run])``."""
        s = self.s
        for u, run, view in s._runs:
            pieces = [pc for pc in u.layout.pieces(u.rank)
                      if run.start <= pc.partition_start < run.start + run.numel]
            yield u, run, view, pieces

    def optimizer_group_names(self) -> list[list[str]]:
        s = self.s
        names = self.trainable_names()
        out: list[list[str]] = [[] for _ in s.optimizer.param_groups]
        for u in s.units:
            for p in u.params:
                if id(p) in s._group_of:
                    out[s._group_of[id(p)]].append(names[id(p)])
        return out

    def param_shards(self) -> dict[str, ParamShard]:
        refuse_with_experts(self.s.units, "a checkpoint", "ep_size=1, or strategy='zero1'/'zero2' (experts saved under their global index)")
        with self.s.stepper.exposed_state(self.s.sharded):
            return self._param_shards()

    def _param_shards(self) -> dict[str, ParamShard]:
        s = self.s
        names = self.trainable_names()
        out = {}
        for u, run, view, pieces in self._pieces_by_run():
            per, scalars = split_optimizer_state(f"unit {u.name or 'root'!r}", view,
                                                 s.optimizer.state.get(view, {}))
            for pc in pieces:
                a = pc.partition_start - run.start
                cut = slice(a, a + pc.numel)
                out[names[id(u.params[pc.index])]] = ParamShard(
                    pc.param_start, pc.param_start + pc.numel,
                    {"param": view.detach()[cut].clone(), **{k: v[cut] for k, v in per.items()}},
                    scalars)
        return out

    def _frozen_units(self) -> list:
        return [u for u in self.s.units if any(not p.requires_grad for p in u.params)]

    def extra_state(self) -> dict[str, torch.Tensor]:
        """Collective if the units hold frozen parameters (see the module docstring)."""
        s = self.s
        values: dict[str, torch.Tensor] = {}
        for u in self._frozen_units():
            full = u.gather_master(0, s.group)
            if full is not None:
                for name, p, v in zip(u.names, u.params, u.param_views(full.to("cpu"))):
                    if not p.requires_grad:
                        values[name] = v.clone()
        if not s.is_global_zero:
            return {}
        extras = self.checkpoint_model_info()["extras"]
        sd = s.module.state_dict()
        aliases = s.plan.aliases
        return {k: values[aliases[k]] if aliases.get(k) in values else sd[k].detach()
                for k in extras if k in values or k not in aliases}

    def load_param_shards(self, reader: ShardReader) -> None:
        """Collective: this rank's master partitions, the optimizer state of its runs, and the
        extras, from whatever ranges the checkpoint holds; then the working shards are refreshed."""
        s = self.s
        refuse_with_experts(s.units, "a checkpoint load",
                            "ep_size=1, or strategy='zero1'/'zero2' (experts saved under their global index)")
        names = self.trainable_names()
        with torch.no_grad():
            for u in s.units:
                for pc in u.layout.pieces(u.rank):
                    p = u.params[pc.index]
                    cut = u.master[pc.partition_start:pc.partition_start + pc.numel]
                    lo, hi = pc.param_start, pc.param_start + pc.numel
                    if id(p) in names:
                        reader.read(names[id(p)], "param", lo, hi, out=cut)
                    else:  # frozen: saved whole as an extra
                        cut.copy_(reader.extra(u.names[pc.index]).reshape(-1)[lo:hi])
        index = {id(m): i for i, m in enumerate(s.sharded.masters)}
        state: dict[int, dict[str, Any]] = {}
        for u, run, view, pieces in self._pieces_by_run():
            params = [names[id(u.params[pc.index])] for pc in pieces]
            kinds = sorted({k for n in params for k in reader.kinds(n)} - {"param"})
            per = {k: torch.zeros(run.numel, dtype=torch.float32) for k in kinds}
            for pc, n in zip(pieces, params):
                a = pc.partition_start - run.start
                lo, hi = pc.param_start, pc.param_start + pc.numel
                for k in kinds:
                    if k in reader.kinds(n):  # else zeros: that parameter had no such state yet
                        reader.read(n, k, lo, hi, out=per[k][a:a + pc.numel])
            # a run steps as one tensor: its scalars (Adam's step) come from its first parameter
            saved = [n for n in params if n in reader.names()]
            scalars = reader.scalars(saved[0]) if saved else {}
            if per or scalars:
                state[index[id(view)]] = {**per, **scalars}
        current = s.optimizer.state_dict()["param_groups"]
        s.optimizer.load_state_dict({"state": state, "param_groups": reader.param_groups(current)})
        self.finish_load(reader)
