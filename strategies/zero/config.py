"""The options ZeRO stages share, validated once when the strategy is built."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_MODES = ("auto", "all_reduce", "reduce_scatter")
#: default elements per gradient-reduction bucket and per parameter all-gather message: about
#: DDP's 25 MB buckets in fp32. On gloo / 2 cores (GPT 21M, 2 ranks) 5e6-element all-gathers took
#: 0.10 s per step against 0.21 s for 2e7: smaller messages keep two collectives in flight on
#: gloo's two worker threads. DeepSpeed's GPU-sized 5e8 was much slower still (MACHINE_FACTS).
BUCKET_NUMEL = 5_000_000


@dataclass(frozen=True)
class ZeroConfig:
    """Sizes are in elements (bucket defaults: :data:`BUCKET_NUMEL`)."""

    #: elements per gradient reduction message
    reduce_bucket_size: int = BUCKET_NUMEL
    #: elements per parameter all-gather message (all ranks' chunks together)
    allgather_bucket_size: int = BUCKET_NUMEL
    #: launch each full gradient bucket while backward continues (ZeRO-2); False waits at once
    overlap_comm: bool = True
    #: gradient partitions live in one contiguous buffer per group (the only layout supported)
    contiguous_gradients: bool = True
    #: dtype of the gradient reduction and of ZeRO-2's gradient partitions
    reduce_dtype: str = "fp32"
    #: "all_reduce" (all-reduce a bucket, keep your slice: faster on gloo), "reduce_scatter"
    #: (each rank receives only its slice: right for NCCL), or "auto" (pick by backend)
    reduce_mode: str = "auto"
    #: each rank's partition is a multiple of this many elements
    partition_alignment: int = 1

    def __post_init__(self) -> None:
        for f in ("reduce_bucket_size", "allgather_bucket_size", "partition_alignment"):
            object.__setattr__(self, f, _positive_int(f, getattr(self, f)))
        for f in ("overlap_comm", "contiguous_gradients"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"ZeRO: {f}={getattr(self, f)!r} must be True or False")
        if not self.contiguous_gradients:
            raise ValueError(
                "ZeRO: contiguous_gradients=False is not supported: zerotrain always keeps "
                "gradient partitions in one contiguous buffer per param group; drop the option")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"ZeRO: reduce_dtype={self.reduce_dtype!r}; valid choices: "
                             f"{', '.join(REDUCE_DTYPES)}")
        if self.reduce_mode not in REDUCE_MODES:
            raise ValueError(f"ZeRO: reduce_mode={self.reduce_mode!r}; valid choices: "
                             f"{', '.join(REDUCE_MODES)}")

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return REDUCE_DTYPES[self.reduce_dtype]

    def resolved_reduce_mode(self, backend: str) -> str:
        """On gloo an all-reduce of a bucket beats ``reduce_scatter_tensor`` of it (MACHINE_FACTS);
        NCCL has a real reduce-scatter."""
        if self.reduce_mode != "auto":
            return self.reduce_mode
        return "reduce_scatter" if backend == "nccl" else "all_reduce"

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _positive_int(name: str, value: object) -> int:
    # 5e7 is a natural way to write a bucket size: accept integral floats, reject the rest
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"ZeRO: {name}={value!r} must be a positive integer (elements)")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"ZeRO: {name}={value!r} must be a whole number of elements")
    if value < 1:
        raise ValueError(f"ZeRO: {name}={value!r} must be >= 1; valid: a whole number of elements >= 1, "
                         f"e.g. {BUCKET_NUMEL}")
    return int(value)
