"""How many parameters a rank holds when experts are spread by expert parallelism: the dense and
expert split of a model, and the per-rank elements each strategy family keeps (issue 46).

With world W and ``ep_size`` n, a rank holds 1/n of the experts. Replicated strategies (DDP) and
ZeRO-1/2 keep those whole; ZeRO-3 partitions them over their expert-data-parallel group of W/n
ranks, so 1/W of the experts, and partitions the dense parameters over the world, 1/W of them.
Padding to equal partitions is not counted (at most a few elements per unit).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParameterSplit:
    """Elements of a model's dense parameters and of all its experts (every rank's together)."""

    dense: int
    experts: int
    ep_size: int

    def per_rank(self, world: int, partitioned: bool) -> tuple[int, int]:
        """(dense, expert) elements one rank holds: ``partitioned`` for ZeRO-3, whole otherwise."""
        if world % self.ep_size:
            raise ValueError(f"world={world}; valid: a multiple of ep_size={self.ep_size}")
        if partitioned:
            return self.dense // world, self.experts // world
        return self.dense, self.experts // self.ep_size


def parameter_split(module: nn.Module, ep_size: int = 1) -> ParameterSplit:
    """The split of ``module``, by moe/'s marks (``allreduce = False``, ``group_name``): placed
    experts (``ep_size_<n>``, n > 1) count n times, as this rank holds 1/n of them; the experts of
    an all-experts model (``ep_size_1``: the layer built with ``ep_size=1``) count once, and
    ``ep_size`` is the one planned."""
    dense = experts = 0
    placed: set[int] = set()
    for _, p in module.named_parameters():
        if getattr(p, "allreduce", True) is False:
            ep = int(getattr(p, "group_name", "ep_size_1")[len("ep_size_"):])
            experts += p.numel() * ep
            if ep > 1:
                placed.add(ep)
        else:
            dense += p.numel()
    if len(placed) > 1 or placed and placed != {ep_size} and ep_size != 1:
        raise ValueError(f"ep_size={ep_size} but the model's experts are placed with ep_size {sorted(placed)}; "
                         "valid: one ep_size, the placed one")
    return ParameterSplit(dense, experts, placed.pop() if placed else ep_size)
