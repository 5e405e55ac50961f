"""The experts a rank holds: ``num_local`` copies of one expert module, each fed its own block of
the buffer. Their parameters carry DeepSpeed's marks (``allreduce = False`` and ``group_name``,
the name of their expert-parallel group), by which optimizers and gradient reducers tell them
from dense parameters."""
from __future__ import annotations

import copy

import torch


def mark_expert(param: torch.nn.Parameter, group_name: str) -> None:
    param.allreduce = False
    param.group_name = group_name


class Experts(torch.nn.Module):
    """``num_local`` deep copies of ``expert`` under ``list_name`` (DeepSpeed's face names it
    ``deepspeed_experts``). Input [ranks, num_local, capacity, model]: expert j gets [:, j]."""

    def __init__(self, expert: torch.nn.Module, num_local: int, group_name: str, list_name: str = "experts") -> None:
        super().__init__()
        self.list_name, self.num_local = list_name, num_local
        setattr(self, list_name, torch.nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local)))
        for module in self.local:
            for param in module.parameters():
                mark_expert(param, group_name)

    @property
    def local(self) -> torch.nn.ModuleList:
        return getattr(self, self.list_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for block, expert in zip(x.chunk(self.num_local, dim=1), self.local):
            out = expert(block)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outs, dim=1)
