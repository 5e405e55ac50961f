"""gpt_bench's systems by name: the defaults, zerotrain's configured variants and pipelines, and
the environment suffix any name may carry (``gpt_bench.py``'s docstring lists them for ``--help``)."""
from __future__ import annotations

from typing import NamedTuple

DEFAULT_SYSTEMS = ["ddp", "fsdp2_zero2", "fsdp2", "ds_zero1", "ds_zero2", "ds_zero3",
                   "zt_ddp", "zt_zero1", "zt_zero2", "zt_zero3"]
#: systems under a configured strategy rather than the name's defaults (only when named):
#: ``_reuse`` keeps half the model gathered from forward to backward, ``_lean`` none (the
#: default "auto" keeps what a quarter of the free memory holds), ``_glibc`` leaves glibc's
#: sliding mmap threshold (``_mm32``: at glibc's 32 MiB maximum), ``_nocache`` runs without the
#: host allocator cache (``host_cache_min_bytes=0``; ``_s64``: the cache may keep 64 MiB above
#: the peak, also ``_s32``, ``_s128``), ``_ovl`` overlaps the
#: post-step all-gathers with the next forward,
#: ``_rs`` / ``_ar`` reduce gradients by reduce-scatter (on gloo an all-to-all) / all-reduce,
#: ``_qwqg`` is ZeRO++ (int8 weight gathers and gradient reductions; losses then differ slightly)
ZT_OPTIONS = {"zt_zero3_reuse": lambda spec: {"max_reuse_distance": spec.num_params() // 2},
              "zt_zero3_lean": lambda spec: {"max_reuse_distance": 0},
              "zt_zero3_glibc": lambda spec: {"host_mmap_threshold": 0},
              "zt_zero2_glibc": lambda spec: {"host_mmap_threshold": 0},
              "zt_zero1_glibc": lambda spec: {"host_mmap_threshold": 0},
              **{f"zt_zero{k}_mm32": lambda spec: {"host_mmap_threshold": 32 << 20} for k in (1, 2, 3)},
              **{f"zt_zero{k}_nocache": lambda spec: {"host_cache_min_bytes": 0} for k in (1, 2, 3)},
              **{f"zt_zero{k}_s{m}": (lambda spec, m=m: {"host_cache_slack_bytes": m << 20})
                 for k in (1, 2, 3) for m in (32, 64, 128)},
              "zt_zero1_ovl": lambda spec: {"overlap_param_gather": True},
              "zt_zero2_ovl": lambda spec: {"overlap_param_gather": True},
              "zt_zero3_qwqg": lambda spec: {"quantize_weights": True, "quantize_gradients": True},
              **{f"zt_zero{k}_{m}": (lambda spec, mode=mode: {"reduce_mode": mode})
                 for k in (1, 2, 3) for m, mode in (("rs", "reduce_scatter"), ("ar", "all_reduce"))}}
#: zerotrain's systems and their strategy: "zt_zeroK_<variant>" runs zeroK with ZT_OPTIONS' options
ZT_STRATEGY = {"zt_ddp": "ddp", "zt_zero1": "zero1", "zt_zero2": "zero2", "zt_zero3": "zero3",
               **{name: name.split("_")[1] for name in ZT_OPTIONS}}


class PipeSystem(NamedTuple):
    """A pipeline system: 2 stages, 1F1B; ``m`` micro-batches per replica batch, ``v`` chunks per
    stage (interleaved when > 1), ``balanced``: the stage boundary placed by estimated compute
    inside a block (``GPT.pipeline_cut``) instead of by parameters between blocks;
    ``schedule``: the pipeline's (``1f1b`` or ``zb_h1``)."""

    m: int
    v: int = 1
    balanced: bool = False
    schedule: str = "1f1b"


PIPE_SYSTEMS = {"zt_pipe_m4": PipeSystem(4), "zt_pipe_m8": PipeSystem(8), "zt_pipe_v2_m8": PipeSystem(8, v=2),
                "zt_pipe_bal_m8": PipeSystem(8, balanced=True), "zt_pipe_zb_m8": PipeSystem(8, schedule="zb_h1"),
                "zt_pipe_zb_bal_m8": PipeSystem(8, balanced=True, schedule="zb_h1"),
                "zt_pipe_zb_bal_m4": PipeSystem(4, balanced=True, schedule="zb_h1")}
#: not a training system (only when named): each rank steps a model of its own on its micro-batch,
#: no communication at all - what the step's compute costs with every core busy, the floor a
#: data-parallel step approaches on this machine (its losses leave DDP's after the first step)
FLOOR_SYSTEMS = ["solo"]
#: compiled systems (only when named): ``<system>_c`` is ``<system>`` compiled as its users compile
#: it (``gpt_compiled.py``)
COMPILED_SYSTEMS = [f"{s}_c" for s in ("ddp", "fsdp2", "fsdp2_zero2", "ds_zero1", "ds_zero2", "ds_zero3",
                                       "zt_ddp", "zt_zero1", "zt_zero2", "zt_zero3")]
ALL_SYSTEMS = DEFAULT_SYSTEMS + list(ZT_OPTIONS) + list(PIPE_SYSTEMS) + FLOOR_SYSTEMS + COMPILED_SYSTEMS
#: a system's name may end in one of these: its ranks run with these environment variables set.
#: ``+thp`` / ``+nothp``: torch's ``THP_MEM_ALLOC_ENABLE`` 1 / 0 (transparent huge pages for
#: allocations of 2 MiB and more; without the suffix the variable is removed, torch's default:
#: off). Measured on model B (bench/RESULTS.md): faults per step fell 4.5-11x, CPU per step rose
#: 10-25% in every system, and zerotrain's zero1 / zero3 got 19% / 28% slower, so zerotrain leaves
#: it off (those runs predate the host cache; with =1 a ZeRO rank now also leaves the cache off,
#: so ``zt_zeroK`` against ``zt_zeroK+thp`` changes both). ``+heap``: glibc serves every
#: allocation from its heap and never returns freed memory (no ``mmap`` at all, no trimming; it
#: overrides zerotrain's ``host_mmap_threshold``): what a rank gains when nothing is page-faulted
#: twice, and what that costs in peak RSS
SUFFIX_ENV = {"+thp": {"THP_MEM_ALLOC_ENABLE": "1"}, "+nothp": {"THP_MEM_ALLOC_ENABLE": "0"},
              "+heap": {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"}}


def base_system(name: str) -> str:
    """``name`` without its environment suffix."""
    for suffix in SUFFIX_ENV:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name
