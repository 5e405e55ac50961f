"""gpt_bench's compiled systems (issue 47) and the MFU table every run prints.

    # a smoke run (one step per system: the harness works; no timing)
    python -m zerotrain.bench.gpt_bench --model tiny --steps 1 --warmup 0 --repeats 1 \\
        --systems ddp,ddp_c,fsdp2_c,fsdp2_zero2_c,ds_zero1_c,ds_zero2_c,ds_zero3_c,zt_zero1,zt_zero1_c,zt_zero2_c,zt_zero3_c
    # a real run: eager and compiled, 2 interleaved rounds (the first steps compile: --warmup 3)
    python -m zerotrain.bench.gpt_bench --model gpt_21m --precision bf16-mixed --steps 10 --warmup 3 --repeats 2 \\
        --systems ddp,ddp_c,fsdp2,fsdp2_c,ds_zero1,ds_zero1_c,ds_zero3,ds_zero3_c,zt_zero1,zt_zero1_c,zt_zero2,zt_zero2_c,zt_zero3,zt_zero3_c \\
        --out bench/RESULTS.md

Each ``<system>_c`` is ``<system>`` compiled the way its own users compile it (inductor):

  ddp_c          ``torch.compile`` of the whole DDP module (DDPOptimizer splits it at the buckets)
  fsdp2_c, fsdp2_zero2_c   each block ``torch.compile``d, then ``fully_shard`` per block and the
                 root, as torchtitan applies compile and FSDP2
  ds_zeroK_c     DeepSpeed's ``engine.compile()`` after ``deepspeed.initialize`` (the whole module)
  zt_ddp_c, zt_zeroK_c   the Trainer with ``compile=True``: one compiled region per block
                 (``strategies/compile.py``; zero3: per unit, the gathers outside the graphs)

The MFU table: the model's training FLOPs per step (``GPT.flops_per_token`` x tokens of all ranks)
over the median step time, against the machine's matmul peak (``matmul_peak``: an n x n matmul
in the run's dtype on one thread, times ranks x threads per rank: the run's cores), and the
first step's time less the median step ("compile s": what compiling, and first-touch allocation,
add once).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any, Callable

import torch

from zerotrain.bench.gpt_systems import COMPILED_SYSTEMS

#: compiled system -> the eager system it compiles
COMPILED_OF = {s: s[:-2] for s in COMPILED_SYSTEMS}


def run_ddp_compiled(args: argparse.Namespace, spec: Any, batches: list, rec: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from zerotrain.bench import gpt_bench as gb
    rec.baseline()
    gb._init_torch_pg()
    model = gb.build_gpt(spec.config(), args.seed, spec.tied)
    ddp = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt, rec.optimizer = gb.make_adamw(model)
    gb._loop(gb._torch_step(torch.compile(ddp), opt, autocast=args.precision == "bf16-mixed"), batches, rec)


def run_fsdp2_compiled(args: argparse.Namespace, spec: Any, batches: list, rec: Any, *,
                       reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zerotrain.bench import gpt_bench as gb
    rec.baseline()
    gb._init_torch_pg()
    model = gb.build_gpt(spec.config(), args.seed, spec.tied)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.precision == "bf16-mixed" else MixedPrecisionPolicy())
    for i, block in enumerate(list(model.blocks)):  # torchtitan's order: compile each block, then shard it
        model.blocks[i] = torch.compile(block)
        fully_shard(model.blocks[i], reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt, rec.optimizer = gb.make_adamw(model)
    gb._loop(gb._torch_step(model, opt, autocast=False), batches, rec)


def run_deepspeed_compiled(args: argparse.Namespace, spec: Any, batches: list, rec: Any, *, stage: int) -> None:
    import deepspeed

    from zerotrain.bench import gpt_bench as gb
    initialize = deepspeed.initialize

    def compiled_initialize(*a: Any, **kw: Any) -> Any:
        out = initialize(*a, **kw)
        out[0].compile()  # DeepSpeed's engine.compile(): the whole module, inductor on CPU
        return out

    deepspeed.initialize = compiled_initialize
    try:
        gb.run_deepspeed(args, spec, batches, rec, stage=stage)
    finally:
        deepspeed.initialize = initialize


def run_zerotrain_compiled(args: argparse.Namespace, spec: Any, batches: list, rec: Any, *, system: str) -> None:
    from zerotrain.bench import gpt_bench as gb
    from zerotrain.strategies import strategy_from_name
    from zerotrain.strategies.compile import CompileConfig

    strategy = strategy_from_name(gb.ZT_STRATEGY[system])
    strategy.compile = CompileConfig()  # what Trainer(compile=True) sets
    gb.run_zerotrain(args, spec, batches, rec, strategy=strategy)


def compiled_runner(system: str) -> Callable:
    """The worker function of a ``<system>_c``."""
    eager = COMPILED_OF[system]
    if eager == "ddp":
        return run_ddp_compiled
    if eager.startswith("fsdp2"):
        return functools.partial(run_fsdp2_compiled, reshard_after_forward=eager == "fsdp2")
    if eager.startswith("ds_zero"):
        return functools.partial(run_deepspeed_compiled, stage=int(eager[-1]))
    return functools.partial(run_zerotrain_compiled, system=eager)


# =============================================================================== MFU
@functools.lru_cache(maxsize=None)
def matmul_peak(dtype: str = "fp32") -> float:
    """FLOP/s of one thread's fastest square matmul in ``dtype`` (``ops/peak.py``'s probe)."""
    from zerotrain.ops.peak import probe_cpu_matmul
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return probe_cpu_matmul(dtype)
    finally:
        torch.set_num_threads(threads)


def step_flops(spec: Any, nproc: int) -> float:
    """Training FLOPs of one optimizer step, all ranks (``GPT.flops_per_token``, built on meta)."""
    from zerotrain.bench.common import gpt_class
    with torch.device("meta"):
        model = gpt_class(spec.tied)(spec.config())
    return model.flops_per_token() * spec.micro_batch * spec.block_size * nproc


def render_mfu(args: argparse.Namespace, results: dict, spec: Any) -> str:
    """The MFU table of a run (median over repeats), eager systems beside their compiled ones."""
    runs = {s: r for s, r in results.items() if r}
    if not runs:
        return ""
    dtype = "bf16" if args.precision == "bf16-mixed" else "fp32"
    peak = matmul_peak(dtype) * args.nproc * args.threads
    flops = step_flops(spec, args.nproc)
    step = {s: statistics.median(x.step_s for x in r) for s, r in runs.items()}
    base = step.get("ddp")
    lines = [f"\nMFU against the {dtype} matmul peak of the run's {args.nproc * args.threads} thread(s): "
             f"{peak / 1e12:.3f} TFLOP/s (one thread's x threads); {flops / 1e9:.2f} GFLOP per step\n",
             "| system | median step (s) | x ddp (eager) | TFLOP/s | MFU | compile s (first step - median) "
             "| peak RSS/rank (GB) |", "|---|---|---|---|---|---|---|"]
    for s, r in runs.items():
        first = statistics.median(x.first_step_s for x in r) - step[s]
        ratio = f"{step[s] / base:.2f}" if base else "-"
        lines.append(f"| {s} | {step[s]:.4f} | {ratio} | {flops / step[s] / 1e12:.3f} | "
                     f"{flops / step[s] / peak * 100:.1f}% | {first:.1f} | "
                     f"{statistics.median(x.rss_peak for x in r) / 1e9:.2f} |")
    return "\n".join(lines) + "\n"
