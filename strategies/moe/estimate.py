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

from ..memory.formula import ModelStates, estimate_model_states, format_bytes


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


def estimate_with_experts(dense: int, experts: int, world: int, ep_size: int, precision: str = "bf16-mixed",
                          optimizer_bytes: int | None = None) -> dict:
    """Per-rank model-state bytes for every stage (``memory.formula.estimate_model_states``'s
    shape) of ``dense`` parameters replicated over ``world`` ranks and ``experts`` (all experts,
    every rank's) spread over ``ep_size``: a rank's experts are a model of ``experts / ep_size``
    parameters replicated over its expert-data-parallel group of ``world / ep_size`` ranks."""
    if ep_size < 1 or world % ep_size or experts % ep_size:
        raise ValueError(f"ep_size={ep_size}; valid: a divisor of the world size {world} and of the expert "
                         f"parameters {experts}")
    if dense < 0 or experts < 0:
        raise ValueError(f"dense={dense}, experts={experts}; valid: counts >= 0 (experts at most the parameters)")
    d = estimate_model_states(dense, world, precision, optimizer_bytes=optimizer_bytes)
    e = estimate_model_states(experts // ep_size, world // ep_size, precision, optimizer_bytes=optimizer_bytes)
    return {s: ModelStates(d[s].params + e[s].params, d[s].grads + e[s].grads, d[s].master + e[s].master,
                           d[s].optimizer + e[s].optimizer) for s in d}


def format_expert_table(num_params: int, experts: int, ep_size: int, world_sizes, precision: str = "bf16-mixed",
                        optimizer_bytes: int = 8) -> str:
    """``zerotrain-estimate --expert-params E --ep-size n``: the model-state table with the dense
    and expert split."""
    lines = [f"Model states per rank for {num_params:,} parameters ({num_params - experts:,} dense, {experts:,} in "
             f"experts over ep_size={ep_size}), precision {precision}, optimizer {optimizer_bytes} bytes/param",
             f"{'ranks':>6} {'stage':>6} {'params':>12} {'grads':>12} {'master':>12} {'optimizer':>12} {'total':>12}"]
    for n in world_sizes:
        for stage, s in estimate_with_experts(num_params - experts, experts, n, ep_size, precision,
                                              optimizer_bytes).items():
            lines.append(f"{n:>6} {stage:>6} " + " ".join(
                f"{format_bytes(v):>12}" for v in (s.params, s.grads, s.master, s.optimizer, s.total)))
    lines.append("Experts: 1/ep_size of them on a rank, partitioned over its ep_size-strided replicas where the "
                 "stage partitions. Activations, buckets and all-to-all buffers come on top.")
    return "\n".join(lines)
