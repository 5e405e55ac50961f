"""Every ZeRO option, written once: the frozen dataclasses the strategies are built from and the
CLI's ``strategy`` schemas are generated from (``registry``). Validated when built; each error
names the field, its value and what is valid.

* :class:`ZeroConfig`: options of every stage (the gradient reduction).
* :class:`BucketConfig`: stages 1 and 2 (flat buffers reduced and gathered in buckets).
* :class:`Stage3Config`: stage 3 (units gathered just in time).
* :class:`ZeroSpec`: a stage and its sections; ``ZeroSpec.from_options(stage, **flat)`` routes flat
  keyword options (``reduce_bucket_size=...``, ``unit_modules=...``) to their section by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..options import check_bool, check_choice, whole_number

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_MODES = ("auto", "all_reduce", "reduce_scatter")
STAGES = (1, 2, 3)
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's HEAP_MAX/2 on 64-bit
#: ``max_reuse_distance="auto"``: this share of what the rank has free once its model is
#: partitioned and its optimizer state counted (``Stage3Config.reuse_budget``)
AUTO_REUSE_SHARE = 0.25


@dataclass(frozen=True)
class ZeroConfig:
    """Options of every stage: how gradients are reduced."""

    #: launch each gradient reduction while backward continues; False waits for each at once
    overlap_comm: bool = True
    #: dtype of the gradient reduction and of the gradient partitions
    reduce_dtype: str = "fp32"
    #: dtype of this rank's master partitions, the gradients the optimizer reads and (with the
    #: user's optimizer, which makes its state like its parameters) its state: "fp32", or the
    #: precision's own 16-bit type ("bf16" under bf16-mixed, "fp16" under 16-mixed), when the
    #: master partition *is* the working one, stepped in place (DeepSpeed's
    #: ``bf16_master_weights_and_grads`` / ``fp16_master_weights_and_grads``): 2 bytes per
    #: element instead of 4 (+4) for the master, and the step's rounding is the optimizer's in
    #: that type
    master_dtype: str = "fp32"
    #: "all_reduce" (all-reduce a bucket, keep your slice), "reduce_scatter" (each rank receives
    #: only its slice; on gloo one all-to-all), or "auto": reduce_scatter, except stages 1 and 2
    #: on gloo with more than 2 ranks (see ``resolved_reduce_mode``)
    reduce_mode: str = "auto"
    #: each rank's partition is a multiple of this many elements
    partition_alignment: int = 1
    #: log every collective (op, bytes, time, bus bandwidth) and summarise it, with the bytes
    #: per step beside the ZeRO formula, at the end of fit (``callbacks.CommsLogger``)
    comms_logger: bool = False
    #: ZeRO++ qgZ (stages 2 and 3): each rank sends every owner its piece of a gradient bucket as
    #: block-wise int8 (one fp32 scale per block) in one all-to-all; the owner dequantizes the
    #: pieces and sums them in fp32. About 1/4 of fp32's bytes; replaces ``reduce_mode``
    quantize_gradients: bool = False
    #: elements per block (one fp32 scale each) of ``quantize_gradients`` and zero3's
    #: ``quantize_weights``: the bytes are 1 + 4/block per element
    quantize_block_size: int = 256
    #: bytes from which the host's allocations get their own mapping, returned to the OS when
    #: freed (glibc's ``M_MMAP_THRESHOLD``, set on every rank at set-up; ``memory/host.py``).
    #: 8 MiB: the 118M GPT's peak RSS per rank 0.11 GB lower at no measured cost; 1 MiB saved
    #: 0.2 GB but cost ~10% of the step in page faults. 0: glibc's own sliding threshold
    host_mmap_threshold: int = 8 << 20
    #: on a CPU rank, keep freed host blocks of at least this many bytes and serve the next large
    #: allocations from their pages, never holding more than the rank's own peak
    #: (``ops/host_cache.py``; compiled, else torch's allocator). 0 turns it off; so does
    #: ``THP_MEM_ALLOC_ENABLE=1`` in the environment (torch's allocator then serves huge pages)
    host_cache_min_bytes: int = 1 << 20
    #: bytes the host cache may keep above that peak (up to this much more peak RSS; since kept
    #: pages serve any size, 0 already leaves few page faults)
    host_cache_slack_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("partition_alignment", "quantize_block_size"):
            object.__setattr__(self, f, whole_number("ZeRO", f, getattr(self, f), 1))
        for f in ("host_mmap_threshold", "host_cache_min_bytes", "host_cache_slack_bytes"):
            object.__setattr__(self, f, whole_number("ZeRO", f, getattr(self, f), 0))
        if self.host_mmap_threshold > MAX_MMAP_THRESHOLD:
            raise ValueError(f"ZeRO: host_mmap_threshold={self.host_mmap_threshold!r} exceeds glibc's limit; "
                             f"valid: 0 (glibc's own) to {MAX_MMAP_THRESHOLD} bytes")
        for f in ("overlap_comm", "comms_logger", "quantize_gradients"):
            check_bool("ZeRO", f, getattr(self, f))
        check_choice("ZeRO", "reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        check_choice("ZeRO", "master_dtype", self.master_dtype, REDUCE_DTYPES)
        check_choice("ZeRO", "reduce_mode", self.reduce_mode, REDUCE_MODES)

    @property
    def torch_reduce_dtype(self) -> torch.dtype:
        return REDUCE_DTYPES[self.reduce_dtype]

    @property
    def torch_master_dtype(self) -> torch.dtype:
        return REDUCE_DTYPES[self.master_dtype]

    def check_master_dtype(self, param_dtype: torch.dtype, precision: str) -> None:
        """A 16-bit ``master_dtype`` is the working partition itself, so it must be the working
        parameters' type (``param_dtype`` of ``precision``)."""
        if self.master_dtype != "fp32" and self.torch_master_dtype != param_dtype:
            same = next((k for k, v in REDUCE_DTYPES.items() if v == param_dtype), None)
            valid = "fp32" + (f" or {same}" if same not in (None, "fp32") else "")
            raise ValueError(f"ZeRO: master_dtype={self.master_dtype!r} with precision={precision!r} (working "
                             f"parameters {str(param_dtype).replace('torch.', '')}): 16-bit masters are the "
                             f"working partitions, stepped in place; valid: {valid}")

    def resolved_reduce_mode(self, backend: str, world: int, even_pieces: bool = False) -> str:
        """``reduce_mode``, "auto" resolved: reduce_scatter, which on gloo is one all-to-all
        (``comm.reduce_to_owners``, ``comm.reduce_scatter_sum``), measured faster than gloo's
        all-reduce of the same buffer (``bench/comm_bench.py``): a stage-1/2 bucket mostly lies
        in one rank's partition, so it goes one way with half an all-reduce's bytes; stage 3's
        units are cut evenly (``even_pieces``), so theirs go both ways at once. Stages 1 and 2
        keep all_reduce on gloo beyond 2 ranks, where a bucket's owner would receive every
        rank's copy of it at once (a scratch of ``world`` times its piece).
        ``quantize_gradients`` makes it "quantized" (an int8 all-to-all), whatever
        ``reduce_mode`` says."""
        if self.quantize_gradients:
            return "quantized"
        if self.reduce_mode != "auto":
            return self.reduce_mode
        return "reduce_scatter" if backend != "gloo" or even_pieces or world <= 2 else "all_reduce"


@dataclass(frozen=True)
class BucketConfig:
    """Stages 1 and 2: the whole model lives in flat buffers, reduced and gathered in buckets.

    The default bucket, 5e6 elements, is about DDP's 25 MB in fp32. On gloo / 2 cores (GPT 21M,
    2 ranks) 5e6-element all-gathers took 0.10 s per step against 0.21 s for 2e7: smaller messages
    keep two collectives in flight on gloo's two worker threads; DeepSpeed's GPU-sized 5e8 was
    much slower still (MACHINE_FACTS)."""

    #: elements per gradient reduction message
    reduce_bucket_size: int = 5_000_000
    #: elements per parameter all-gather message (all ranks' chunks together)
    allgather_bucket_size: int = 5_000_000
    #: leave the post-step all-gathers in flight; each forward waits only for its own module's
    overlap_param_gather: bool = False

    def __post_init__(self) -> None:
        for f in ("reduce_bucket_size", "allgather_bucket_size"):
            object.__setattr__(self, f, whole_number("ZeRO", f, getattr(self, f), 1))
        check_bool("ZeRO", "overlap_param_gather", self.overlap_param_gather)


@dataclass(frozen=True)
class Stage3Config:
    """Stage 3: parameters partitioned too, gathered one unit at a time. Sizes are in elements."""

    #: which modules are units: None (children of every nn.ModuleList), class names (a list, or
    #: one comma-separated string as on the command line), or a callable (name, module) -> bool
    unit_modules: "tuple[str, ...] | Callable[[str, nn.Module], bool] | None" = None
    #: free a unit after its forward (True) or keep it gathered until its backward (ZeRO-2-like
    #: memory for the parameters, one all-gather fewer per unit and step)
    reshard_after_forward: bool = True
    #: elements to all-gather ahead of the unit in use (0: no prefetch); gathers start while
    #: fewer than this many elements are ahead, so at least one unit is. 1e7: one 118M-GPT block
    #: (12.6M), as FSDP2 prefetches; DeepSpeed's 5e7 held four there, 0.1 GB more per rank at
    #: no measured speed-up
    prefetch_bucket_size: int = 10_000_000
    #: most gathered elements at once (the unit in use may exceed it by itself)
    max_live_parameters: int = 1_000_000_000
    #: with reshard_after_forward, keep a unit gathered after its forward when the elements
    #: of the other units gathered before its backward (by the step's recorded order: the last
    #: blocks of the forward are the first of the backward) are at most this many, within
    #: max_live_parameters: one all-gather fewer per kept unit and step (DeepSpeed's
    #: ``stage3_max_reuse_distance``; 0: free every unit after its forward). "auto": a budget
    #: from the rank's memory (``reuse_budget``: a quarter of what is free once the model is
    #: partitioned and the optimizer state counted, the least over ranks), 0 under offload
    max_reuse_distance: "int | str" = "auto"
    #: parameters of at most this many elements stay whole on every rank (0: none)
    param_persistence_threshold: int = 0
    #: recompute each unit's forward in backward (non-reentrant torch.utils.checkpoint)
    activation_checkpointing: bool = False
    #: ZeRO++ qwZ: a unit's all-gather sends block-wise int8 (``quantize_block_size``, one fp32
    #: scale per block) dequantized on arrival; the fp32 masters are untouched. About 1/4 of an
    #: fp32 gather's bytes (1/2 of bf16's), at the price of int8 rounding in the working weights
    quantize_weights: bool = False
    #: ZeRO++ hpZ: each unit's forward gather leaves a copy of its values spread over the ranks
    #: of each node (1/local_world_size per rank), and backward gathers it within the node only;
    #: costs that copy's memory, keeps the second gather per step off the inter-node network
    hierarchical_partition: bool = False

    def __post_init__(self) -> None:
        from .stage3.unit_plan import make_policy

        units = self.unit_modules
        if isinstance(units, str):
            units = [n.strip() for n in units.split(",") if n.strip()]
        make_policy(units)  # raises for anything but names, a callable or None
        if units is not None and not callable(units):
            units = tuple(units)
        object.__setattr__(self, "unit_modules", units)
        for f in ("reshard_after_forward", "activation_checkpointing", "quantize_weights",
                  "hierarchical_partition"):
            check_bool("zero3", f, getattr(self, f))
        fields_least = [("prefetch_bucket_size", 0), ("max_live_parameters", 1), ("param_persistence_threshold", 0)]
        if self.max_reuse_distance != "auto":
            if isinstance(self.max_reuse_distance, str):
                raise ValueError(f"zero3: max_reuse_distance={self.max_reuse_distance!r}; valid: 'auto' or a "
                                 "whole number >= 0 (elements)")
            fields_least.append(("max_reuse_distance", 0))
        for f, least in fields_least:
            object.__setattr__(self, f, whole_number("zero3", f, getattr(self, f), least))

    def reuse_budget(self, free_bytes: int, shard_elements: int, element_size: int) -> int:
        """``max_reuse_distance`` in elements: the given number, or for "auto" a quarter
        (``AUTO_REUSE_SHARE``) of ``free_bytes`` less the optimizer state still to come (two fp32
        values per element of this rank's ``shard_elements``, as Adam keeps), in elements of
        ``element_size`` bytes, within ``max_live_parameters``."""
        if self.max_reuse_distance != "auto":
            return int(self.max_reuse_distance)
        room = max(0, free_bytes - 8 * shard_elements)
        return min(int(room * AUTO_REUSE_SHARE) // max(1, element_size), self.max_live_parameters)


#: the sections a stage has (besides ZeroConfig)
_SECTIONS: dict[str, type] = {"buckets": BucketConfig, "stage3": Stage3Config}
_STAGE_SECTIONS = {1: ("buckets",), 2: ("buckets",), 3: ("stage3",)}


@dataclass(frozen=True)
class ZeroSpec:
    """A ZeRO stage and the option sections it uses (the other section is None)."""

    stage: int = 2
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    buckets: Optional[BucketConfig] = None
    stage3: Optional[Stage3Config] = None

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in STAGES:
            raise ValueError(f"ZeRO: stage={self.stage!r}; valid choices: {', '.join(map(str, STAGES))}")
        for name, cls in _SECTIONS.items():
            used = name in _STAGE_SECTIONS[self.stage]
            if getattr(self, name) is None and used:
                object.__setattr__(self, name, cls())
            elif getattr(self, name) is not None and not used:
                raise ValueError(f"ZeRO: {name}= is not a section of stage={self.stage}")
        if self.zero.quantize_gradients and self.stage == 1:
            raise ValueError("ZeRO: quantize_gradients=True: stage 1 all-reduces whole gradients, which "
                             "an all-to-all of owners' pieces cannot replace; valid: stage=2 or 3")

    @classmethod
    def from_options(cls, stage: int, owner: str = "ZeRO", **options: Any) -> "ZeroSpec":
        """The spec from flat options, each routed to the section that has a field of its name.
        An option of a section this stage does not use must stay at its default."""
        probe = cls(stage=stage)  # validates the stage
        sections: dict[str, dict[str, Any]] = {"zero": {}, **{n: {} for n in _SECTIONS}}
        where = {f.name: "zero" for f in fields(ZeroConfig)}
        where.update({f.name: n for n, c in _SECTIONS.items() for f in fields(c)})
        for key, value in options.items():
            if key not in where:
                raise TypeError(f"{owner}: {key}={value!r} is not an option; valid: {', '.join(where)}")
            sections[where[key]][key] = value
        built: dict[str, Any] = {"zero": ZeroConfig(**sections["zero"])}
        for name, cls_ in _SECTIONS.items():
            if getattr(probe, name) is not None:
                built[name] = cls_(**sections[name])
                continue
            for key, value in sections[name].items():
                default = cls_.__dataclass_fields__[key].default
                if value != default:
                    raise ValueError(f"{owner}: {key}={value!r} is not an option of stage={stage} "
                                     f"(a {cls_.__name__} field); leave it at its default {default!r}")
        return cls(stage=stage, **built)

    def options(self) -> dict[str, Any]:
        """The flat options of this spec (for ``repr`` and logs)."""
        out: dict[str, Any] = {"stage": self.stage}
        for section in (self.zero, self.buckets, self.stage3):
            if section is not None:
                out.update({f.name: getattr(section, f.name) for f in fields(section)})
        return out
