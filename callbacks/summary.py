"""ModelSummary: parameters per module, and what this strategy keeps on each rank."""
from __future__ import annotations

import logging
from typing import Any

import torch

from .base import Callback

log = logging.getLogger("zerotrain")


class ModelSummary(Callback):
    """At fit start, a table of the module's sub-modules to ``max_depth`` (name, type, parameters;
    counted at their full shapes, whichever strategy shards them), the trainable, frozen and total
    counts, and the bytes held per rank under the current strategy by category
    (``strategies/memory.py``: params, grads, master, optimizer, comm_buffers; largest rank).
    Logged on global rank 0; ``rows``, ``totals`` and ``bytes_per_rank`` keep the numbers."""

    def __init__(self, max_depth: int = 1) -> None:
        if max_depth < -1:
            raise ValueError(f"ModelSummary: max_depth={max_depth!r}; valid: -1 (all), 0 (none) or more")
        self.max_depth = max_depth
        self.rows: list[tuple[str, str, int]] = []
        self.totals: dict[str, int] = {}
        self.bytes_per_rank: dict[str, int] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.rows = module_rows(pl_module, self.max_depth)
        self.totals = parameter_totals(pl_module)
        self.bytes_per_rank = max_bytes_per_rank(trainer.strategy)
        if trainer.is_global_zero:
            log.info("%s", self.table())

    def table(self) -> str:
        width = max([len(n) for n, _, _ in self.rows] + [4])
        lines = [f"  | {'Name':<{width}} | {'Type':<24} | Params"]
        lines += [f"{i:<2}| {n:<{width}} | {t:<24} | {_count(p)}" for i, (n, t, p) in enumerate(self.rows)]
        t = self.totals
        lines += [f"{_count(t['trainable'])} trainable params", f"{_count(t['frozen'])} non-trainable params",
                  f"{_count(t['total'])} total params"]
        lines += [f"{_bytes(v)} {k} per rank (largest rank)" for k, v in self.bytes_per_rank.items() if v]
        return "\n".join(lines)


def module_rows(module: torch.nn.Module, max_depth: int) -> list[tuple[str, str, int]]:
    rows = []
    for name, sub in module.named_modules():
        depth = name.count(".") + 1 if name else 0
        if name and (max_depth == -1 or depth <= max_depth):
            rows.append((name, type(sub).__name__, sum(p.numel() for p in sub.parameters())))
    return rows


def parameter_totals(module: torch.nn.Module) -> dict[str, int]:
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen}


def max_bytes_per_rank(strategy: Any) -> dict[str, int]:
    """``count_bytes`` of this rank, the largest over ranks in each category (a collective)."""
    from ..strategies.memory import count_bytes

    mine = count_bytes(strategy)
    names = list(mine)
    most = strategy.reduce(torch.tensor([float(mine[n]) for n in names], dtype=torch.float64), op="max")
    return {n: int(v) for n, v in zip(names, most.tolist())}


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
