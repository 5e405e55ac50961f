"""The ZeRO paper's per-rank model-state bytes (parameters, gradients, fp32 masters, optimizer
state) for each way of distributing them: the formula ``zerotrain-estimate`` prints
(``zero/estimate.py``) and the ZeRO strategies log beside what they measure. Pure arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: precision -> bytes per parameter of (working param, gradient, fp32 master, optimizer state)
PRECISION_BYTES = {
    "32": (4, 4, 0, 8),
    "bf16-mixed": (2, 2, 4, 8),
    "16-mixed": (2, 2, 4, 8),
}
STAGES = ("ddp", "zero1", "zero2", "zero3")
#: which of (params, grads, master, optimizer) each stage partitions over the ranks
_PARTITIONED = {
    "ddp": (False, False, False, False),
    "zero1": (False, False, True, True),
    "zero2": (False, True, True, True),
    "zero3": (True, True, True, True),
}


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds."""

    params: int
    grads: int
    master: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


def estimate_model_states(num_params: int, world_size: int, precision: str = "bf16-mixed", *,
                          param_bytes: int | None = None, grad_bytes: int | None = None,
                          master_bytes: int | None = None, optimizer_bytes: int | None = None,
                          ) -> dict[str, ModelStates]:
    """Per-rank model-state bytes for every stage. ``optimizer_bytes`` is the optimizer's state
    per parameter (Adam: 8, SGD with momentum: 4); the other ``*_bytes`` override the precision's
    defaults (e.g. ``grad_bytes=4`` for ZeRO-2 gradient partitions kept in fp32)."""
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; valid choices: {', '.join(PRECISION_BYTES)}")
    defaults = PRECISION_BYTES[precision]
    given = (param_bytes, grad_bytes, master_bytes, optimizer_bytes)
    per_param = [d if g is None else g for d, g in zip(defaults, given)]
    for name, b in zip(("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"), per_param):
        if b < 0:
            raise ValueError(f"{name}={b} must be >= 0")
    shard = math.ceil(num_params / world_size)
    return {stage: ModelStates(*(b * (shard if part else num_params)
                                 for b, part in zip(per_param, _PARTITIONED[stage])))
            for stage in STAGES}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
