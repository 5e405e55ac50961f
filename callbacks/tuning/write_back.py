"""Weights a callback wrote into the module's parameters, made the ones training goes on from.

A strategy that steps its parameters as they are (single, ddp: ``supports_float64``) needs
nothing. ZeRO-1/2 step fp32 master copies and refresh the module's parameters from them after each
step and load, and a checkpoint saves the masters; so the module's new weights go into the
masters through the strategy's own loader (``load_param_shards``), read from a
:class:`ModuleShardReader` that serves the module's weights and this rank's unchanged optimizer
state and buffers. Collective: every rank calls it together."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ModuleShardReader:
    """A ``strategies.base.ShardReader`` over the module as it is now: ``"param"`` from its
    parameters, every other kind (optimizer state) and the scalars from this rank's
    ``strategy.param_shards()``, buffers and frozen parameters from its ``state_dict``."""

    def __init__(self, strategy: Any, module: nn.Module) -> None:
        self.shards = strategy.param_shards()
        self.params = dict(module.named_parameters())
        self.state = module.state_dict()

    def names(self) -> list[str]:
        return list(self.shards)

    def kinds(self, name: str) -> list[str]:
        shard = self.shards.get(name)
        return ["param", *(k for k in shard.tensors if k != "param")] if shard is not None else ["param"]

    def read(self, name: str, kind: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if kind == "param":
            value = self.params[name].detach().reshape(-1)[start:end]
        else:
            shard = self.shards[name]
            if not shard.start <= start <= end <= shard.end:
                raise RuntimeError(f"write_back: {name!r} {kind} [{start}, {end}) is outside this rank's shard "
                                   f"[{shard.start}, {shard.end})")
            value = shard.tensors[kind][start - shard.start:end - shard.start]
        if out is None:
            return value.to("cpu", torch.float32, copy=True)
        out.copy_(value)
        return out

    def scalars(self, name: str) -> dict[str, torch.Tensor]:
        shard = self.shards.get(name)
        return dict(shard.scalars) if shard is not None else {}

    def extra(self, name: str) -> torch.Tensor:
        return self.state[name]

    def param_groups(self, current: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return current


def write_back(strategy: Any, module: nn.Module) -> None:
    """The module's current parameters become the strategy's masters (nothing to do where the
    strategy steps the parameters themselves)."""
    if strategy.supports_float64 or strategy.optimizer is None:
        return
    strategy.load_param_shards(ModuleShardReader(strategy, module))
