"""ZeRO side by side: one GPT, one data stream, ten ways to train it data-parallel on CPU, and
zerotrain's pipeline beside them.

    python -m zerotrain.bench.gpt_bench --prepare                      # build DeepSpeed's op once
    python -m zerotrain.bench.gpt_bench --model tiny --steps 3 --warmup 1 --repeats 1   # smoke
    python -m zerotrain.bench.gpt_bench --model gpt_21m --out bench/RESULTS.md          # a real run

    # the pipeline (2 stages, 1F1B, m = 4 and 8) against DDP, zero2 and zero3: the 118M GPT with an
    # untied head, fp32, a global batch of 8 sequences (~10-12 min on 2 quiet cores)
    python -m zerotrain.bench.gpt_bench --model gpt_118m_untied \
        --systems ddp,zt_zero2,zt_zero3,zt_pipe_m4,zt_pipe_m8 --steps 3 --warmup 1 --repeats 2 --out bench/RESULTS.md
    # (append ,zt_pipe_bal_m8 to --systems for the compute-balanced cut: ~2 min more)
    # its quick check (tiny dims, seconds per run): every system's loss at every step agrees
    python -m zerotrain.bench.gpt_bench --model tiny_untied \
        --systems ddp,zt_zero2,zt_zero3,zt_pipe_m4,zt_pipe_m8 --steps 2 --warmup 1 --repeats 1

Systems (``--systems``, a comma list; all by default):

  ddp          torch DistributedDataParallel, a plain torch loop (the baseline, ratio 1.00)
  fsdp2_zero2  torch FSDP2 ``fully_shard`` per block, then the root, reshard_after_forward=False
  fsdp2        torch FSDP2 with its defaults (parameters resharded after forward: ~ZeRO-3)
  ds_zero1/2/3 DeepSpeed (DS_ACCELERATOR=cpu, gloo), torch's fused AdamW (``torch_adam``),
               2e7-element buckets, ``stage3_max_reuse_distance: 0``
  zt_ddp, zt_zero1/2/3   zerotrain's Trainer with strategy ddp / zero1 / zero2 / zero3, as users
               run it (logger, checkpointing and progress bar off); zero3 only once registered;
               zt_zero3_reuse (only when named): zero3 with ``max_reuse_distance`` half the
               model's parameters (the later blocks stay gathered from forward to backward)
  zt_pipe_m4, zt_pipe_m8   (only when named) zerotrain's pipeline through the same Trainer: 2
               stages x nproc/2 replicas, 1F1B, each replica's batch (2 x micro-batch rows: the
               same global batch) in m = 4 / 8 micro-batches; the module cuts the same GPT into
               stages (``GPT.pipeline_layers``); zt_pipe_v2_m8: interleaved, 2 chunks per stage;
               zt_pipe_bal_m8: the stage boundary placed by estimated compute inside a block
               (``GPT.pipeline_cut``: the CLI's ``model.pipeline_cut=compute``);
               zt_pipe_zb_m8, zt_pipe_zb_bal_m8/_m4: the zero-bubble schedule (``schedule="zb_h1"``:
               each backward split, the linear weights' gradients where the stage would wait)
  <system>_c   (only when named) the system compiled, as its users compile it: gpt_compiled.py
  solo         (only when named) not a training system: each rank steps a model of its own on its
               micro-batch, a plain torch loop without any communication: the step's compute
               with every core busy, the floor a data-parallel step approaches here (it steps
               the whole model, where ZeRO steps a shard; its losses leave DDP's after step 0).
               solo+heap takes almost no page fault (see +heap)
  <system>+thp, <system>+nothp   any system with torch's THP_MEM_ALLOC_ENABLE=1 / 0 in its ranks'
               environment (transparent huge pages for allocations of 2 MiB and more); without a
               suffix the variable is removed (torch's default: off). With =1 a zerotrain ZeRO
               rank also runs without its host cache (which would drop the request)
  <system>+heap  any system with glibc's heap serving every allocation, none returned
               (GLIBC_TUNABLES mmap_max=0 and trim_threshold=4 GiB in its ranks' environment;
               without the suffix GLIBC_TUNABLES is removed)

How it measures. The driver (this file, no ``--worker``) runs every system as its own ``torchrun
--standalone --nproc_per_node 2`` job of this file's worker entry, with ``OMP_NUM_THREADS=1``
(one thread per rank: 2 ranks x 2 threads on 2 cores was 2x slower, MACHINE_FACTS.md). Repeats
are interleaved (each system once, then each again), so the machine's drift hits all alike; the
figure per system is the median over repeats. Within a run, each rank times every step from the
end of the previous optimizer step to the end of its own (for the Trainer: a callback's
``on_train_batch_end``), drops ``--warmup`` steps and takes the median; the run's figure is the
slowest rank's. Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss``, which includes the imports;
"dRSS" is the peak minus the peak before the process group and the model existed. "faults/step":
each step's minor page faults (pages touched for the first time, zeroed by the kernel), the
largest rank's, the median over timed steps: a cost the step time's noise hides. "CPU s/step":
the CPU time all ranks used per step; with 2+ repeats, a table of each repeat's ratio to DDP in
the same repeat follows (``gpt_report.py`` renders the tables). The data-parallel
systems run each rank's micro-batch as one forward/backward (no accumulation). For the pipeline
the strategy times each step's schedule per stage (``last_step_stats``): the bubble is the share
of a stage's schedule outside its forward/backward compute (waiting on or moving activations),
the median over timed steps, the mean over stages, beside the theory (p-1)/(v*m+p-1).

Correctness. Every system builds the same weights (``common.build_gpt``), each rank sees the same
micro-batches in every system (``common.make_batches``), and all step the same AdamW with a
constant learning rate. The loss of a step is the mean over ranks of the ranks' micro-batch
losses (the pipeline's: the global batch's mean loss, on every rank); in fp32 every system's
curve must match DDP's to rounding ("max |dloss|"; the last table lists every step's loss).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

from zerotrain.bench.common import (MODELS, OPTIM, WEIGHT_DECAY, ModelSpec, Record, build_gpt, make_adamw,
                                    make_batches, param_groups)
from zerotrain.bench.gpt_report import PIPE_STAGES, RunSummary, render, summarise_run
from zerotrain.bench.gpt_compiled import compiled_runner, render_mfu
from zerotrain.bench.gpt_systems import (ALL_SYSTEMS, COMPILED_SYSTEMS, DEFAULT_SYSTEMS, PIPE_SYSTEMS, SUFFIX_ENV,
                                        ZT_OPTIONS, ZT_STRATEGY, PipeSystem, base_system)

BUCKET = 20_000_000  # elements; DeepSpeed's 5e8 default is GPU-sized (MACHINE_FACTS.md)
PG_TIMEOUT_S = 600


# =============================================================================== worker side
# Each ``run_*`` imports its library, records the RSS baseline, joins the process group, builds
# the model and optimizer, then runs every step in ``batches`` and records it in ``rec``.

def _init_torch_pg() -> None:
    from zerotrain.strategies.environment import init_default_group

    # the same group every system gets, made so that destroying it joins gloo's threads
    init_default_group(backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _loop(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batches: list, rec: Record) -> None:
    rec.setup_done()
    rec.start()
    for x, y in batches:
        rec.step_end(step(x, y))


def _torch_step(model: torch.nn.Module, opt: torch.optim.Optimizer, autocast: bool
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A plain PyTorch training step (DDP, FSDP2); ``autocast``: forward under bf16 autocast."""
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run_ddp(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *, ddp: bool = True) -> None:
    """Torch DDP; ``ddp=False`` is ``solo``: the same loop on this rank's model alone, no collective
    in its steps (the group exists for the end's barrier)."""
    from torch.nn.parallel import DistributedDataParallel

    rec.baseline()
    _init_torch_pg()
    model = build_gpt(spec.config(), args.seed, spec.tied)
    if ddp:
        model = DistributedDataParallel(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt, rec.optimizer = make_adamw(model)
    _loop(_torch_step(model, opt, autocast=args.precision == "bf16-mixed"), batches, rec)


def run_fsdp2(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *,
              reshard_after_forward: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rec.baseline()
    _init_torch_pg()
    model = build_gpt(spec.config(), args.seed, spec.tied)
    # bf16-mixed as torchtitan sets it: bf16 compute copies, fp32 gradient reduction and master.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.precision == "bf16-mixed" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt, rec.optimizer = make_adamw(model)
    _loop(_torch_step(model, opt, autocast=False), batches, rec)  # bf16: the policy above casts


def deepspeed_config(spec: ModelSpec, stage: int, precision: str, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": spec.micro_batch * world,
        "optimizer": {"type": "AdamW", "params": {
            "lr": OPTIM["lr"], "betas": list(OPTIM["betas"]), "eps": OPTIM["eps"],
            "weight_decay": WEIGHT_DECAY,  # the param groups' own values take precedence
            "torch_adam": True, "fused": True}},  # torch.optim.AdamW(fused=True), as every system
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
            "stage3_prefetch_bucket_size": BUCKET,
            "stage3_max_reuse_distance": 0,  # else small models stay gathered from forward to backward
        },
        "bf16": {"enabled": precision == "bf16-mixed"},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *,
                  stage: int) -> None:
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    rec.baseline()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    world = torch.distributed.get_world_size()
    model = build_gpt(spec.config(), args.seed, spec.tied)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                             config=deepspeed_config(spec, stage, args.precision, world))
    inner = getattr(opt, "optimizer", opt)
    fused = any(g.get("fused") for g in inner.param_groups)
    rec.optimizer = f"{type(inner).__name__}{'(fused)' if fused else ''}"

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    _loop(step, batches, rec)


def run_zerotrain(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *,
                  strategy: Any, balanced_cut: bool = False) -> None:
    """The Trainer under ``strategy`` (a name or a Strategy). Under the pipeline the module cuts
    its GPT into stages itself (``to_pipeline``), and every step's schedule timings are kept."""
    from zerotrain import Callback, Trainer, TrainModule

    class BenchModule(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_gpt(spec.config(), args.seed, spec.tied)

        def to_pipeline(self, num_stages: int):
            """The pipeline's hook: the built GPT's layers (``GPT.pipeline_layers``, as the demo
            GPTModule cuts it), so every stage starts from the weights every other system has."""
            from zerotrain.examples.gpt import lm_loss
            from zerotrain.strategies.pipeline import PipelineModule

            if not isinstance(self.model, PipelineModule):
                layers, method = (self.model.pipeline_cut(num_stages) if balanced_cut
                                  else (self.model.pipeline_layers(), "parameters"))
                self.model = PipelineModule.from_modules(layers, num_stages, loss_fn=lm_loss, partition_method=method)
            return self.model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)[1]

        def configure_optimizers(self):
            opt, rec.optimizer = make_adamw(self)
            return opt

    class StepTimer(Callback):
        def on_fit_start(self, trainer, module) -> None:  # model, optimizer and data are set up
            rec.setup_done()
            rec.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            # after the optimizer step; outputs is Lightning's dict, its loss divided by the accumulation
            rec.step_end(outputs["loss"] * trainer.accumulate_grad_batches)
            stats = getattr(trainer.strategy, "last_step_stats", None)  # the pipeline's schedule
            if stats is not None:
                rec.schedule.append({"compute_s": stats.compute_s, "comm_s": stats.comm_s, "wall_s": stats.wall_s})

    rec.baseline()
    trainer = Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                      precision=args.precision, max_steps=len(batches), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[StepTimer()],
                      log_every_n_steps=10**9, seed=args.seed, default_root_dir=args.result_dir)
    trainer.fit(BenchModule(), train_dataloaders=batches)  # a list of this rank's batches: no sampler


def run_configured(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *, system: str) -> None:
    """zerotrain's strategy of ``ZT_STRATEGY[system]`` with ``ZT_OPTIONS[system]``'s options."""
    from zerotrain.strategies import strategy_from_name

    strategy = strategy_from_name(ZT_STRATEGY[system], **ZT_OPTIONS[system](spec))
    run_zerotrain(args, spec, batches, rec, strategy=strategy)


def run_pipeline(args: argparse.Namespace, spec: ModelSpec, batches: list, rec: Record, *,
                 system: PipeSystem) -> None:
    """zerotrain's pipeline: PIPE_STAGES stages, 1F1B (interleaved over ``system.v`` chunks per
    stage when > 1), each replica's batch in ``system.m`` micro-batches."""
    from zerotrain.strategies.pipeline import PipelineStrategy

    strategy = PipelineStrategy(stages=PIPE_STAGES, schedule=system.schedule, micro_batches=system.m,
                                virtual_stages=system.v)
    run_zerotrain(args, spec, batches, rec, strategy=strategy, balanced_cut=system.balanced)


def rank_batches(args: argparse.Namespace, spec: ModelSpec, rank: int, world: int) -> list:
    """This rank's batch of every step. Data-parallel: its ``micro_batch`` rows of the global
    batch. Pipeline: its replica's ``PIPE_STAGES * micro_batch`` rows (every stage of a replica
    gets them: the first its inputs, the last its targets). The global batch is the same."""
    steps = args.warmup + args.steps
    if base_system(args.worker) in PIPE_SYSTEMS:
        spec = dataclasses.replace(spec, micro_batch=spec.micro_batch * PIPE_STAGES)
        rank, world = rank // PIPE_STAGES, world // PIPE_STAGES  # replica r: ranks r*stages ...
    return make_batches(spec, args.data, args.seed, steps, rank, world)


def _worker_runner(system: str) -> Callable:
    if system in COMPILED_SYSTEMS:
        return compiled_runner(system)
    if system == "ddp":
        return run_ddp
    if system == "solo":
        return functools.partial(run_ddp, ddp=False)
    if system.startswith("fsdp2"):
        return functools.partial(run_fsdp2, reshard_after_forward=system == "fsdp2")
    if system.startswith("ds_zero"):
        return functools.partial(run_deepspeed, stage=int(system[-1]))
    if system in ZT_OPTIONS:
        return functools.partial(run_configured, system=system)
    if system in ZT_STRATEGY:
        return functools.partial(run_zerotrain, strategy=ZT_STRATEGY[system])
    if system in PIPE_SYSTEMS:
        return functools.partial(run_pipeline, system=PIPE_SYSTEMS[system])
    raise SystemExit(f"--worker {system!r}: valid choices: {', '.join(ALL_SYSTEMS)}")


def worker_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    # DeepSpeed calls torch collectives torch deprecates; their warnings would be printed inside
    # timed steps (ZeRO-3: every step), so they are silenced for every system alike.
    warnings.filterwarnings("ignore", category=FutureWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = MODELS[args.model]
    batches = rank_batches(args, spec, rank, world)
    rec = Record(system=args.worker, rank=rank, world=world)
    _worker_runner(base_system(args.worker))(args, spec, batches, rec)
    rec.write(args.result_dir)
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while a peer still talks to it
        dist.destroy_process_group()


# =============================================================================== driver side
def child_env(args: argparse.Namespace, system: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=args.ext_dir)
    for name in {name for values in SUFFIX_ENV.values() for name in values}:
        env.pop(name, None)  # the driver's own settings do not leak into the systems' ranks
    env.update(SUFFIX_ENV.get(system[len(base_system(system)):], {}))
    return env


def prepare_deepspeed(args: argparse.Namespace) -> str | None:
    """Build (first time, minutes) or load DeepSpeed's ``deepspeed_shm_comm`` op into
    ``--ext-dir``, so no timed run builds it. Returns why DeepSpeed cannot run, or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable (pip install 'deepspeed==0.19.8', the bench extra)"
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
            "b is None or b.load()\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(args), capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return f"deepspeed's shm_comm op did not build/load: {tail[0]}"
    print(f"deepspeed_shm_comm ready in {args.ext_dir} ({time.perf_counter() - start:.0f} s)", flush=True)
    return None


def zerotrain_skip(args: argparse.Namespace, system: str) -> str | None:
    """Why a zerotrain system cannot run here, or None."""
    from zerotrain.strategies import available

    name = ZT_STRATEGY.get(system, "pipeline")
    if name not in available():
        return f"zerotrain strategy {name!r} is not registered yet"
    if system not in PIPE_SYSTEMS:
        return None
    rows, m = MODELS[args.model].micro_batch * PIPE_STAGES, PIPE_SYSTEMS[system].m
    if args.nproc % PIPE_STAGES:
        return f"--nproc={args.nproc} is not a multiple of the pipeline's {PIPE_STAGES} stages"
    if rows % m:
        return f"a replica's batch of {rows} rows does not split into m={m} equal micro-batches"
    return None


def worker_flags(args: argparse.Namespace, system: str, result_dir: str) -> list[str]:
    return ["--worker", system, "--model", args.model, "--precision", args.precision, "--data", args.data,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--result-dir", result_dir]


def run_system(args: argparse.Namespace, system: str, rep: int, workdir: str) -> RunSummary | str:
    """One torchrun job of ``system``; its summary, or why it failed (its log stays in ``workdir``)."""
    result_dir = os.path.join(workdir, f"{system}.rep{rep}")
    os.makedirs(result_dir, exist_ok=True)
    log_path = result_dir + ".log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "zerotrain.bench.gpt_bench", *worker_flags(args, system, result_dir)]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(args, system),
                                start_new_session=True)  # its own process group: killable as one
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {args.timeout} s (log: {log_path})"
    wall = time.perf_counter() - start
    files = [os.path.join(result_dir, f"rank{r}.json") for r in range(args.nproc)]
    if not all(os.path.exists(f) for f in files):
        return f"exit code {rc}: {_error_line(log_path)} (log: {log_path})"
    records = []
    for f in files:
        with open(f) as fh:
            records.append(json.load(fh))
    summary = summarise_run(records, args.warmup)
    if rc != 0:  # every rank finished and wrote its record: the measurement stands, the exit is noted
        summary.exit_note = f"rep {rep} exited with code {rc} after writing its results: {_error_line(log_path)}"
        print(f"  {system:12s} rep {rep}: {summary.exit_note} (log: {log_path})", flush=True)
    print(f"  {system:12s} rep {rep}: {summary.step_s:.4f} s/step, wall {wall:.0f} s", flush=True)
    return summary


def _error_line(log_path: str) -> str:
    """The log's last line that names an exception or a signal (skipping torchrun's own
    ChildFailedError stack), or its last line."""
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    keys = ("Error", "Exception", "terminate called", "Signal ", "Killed")
    for ln in reversed(lines):
        if "ChildFailedError" not in ln and "/elastic/" not in ln and any(k in ln for k in keys):
            return ln[-300:]
    return lines[-1][-300:] if lines else "(empty log)"


def machine_info() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        cpu = "?"
    try:
        ds = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds = "not installed"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    return {"cpu": cpu, "cores": str(len(os.sched_getaffinity(0))), "torch": torch.__version__, "deepspeed": ds,
            "bf16_note": "" if bf16 or not flags else
            " **This CPU has no AMX / AVX512-BF16: bf16 matmuls are far slower than fp32 here, so bf16-mixed "
            "figures are not representative.**"}


def pipeline_note(args: argparse.Namespace, systems: list[str]) -> str:
    """How the pipeline systems cut the same global batch, for the header."""
    if not any(base_system(s) in PIPE_SYSTEMS for s in systems):
        return ""
    rows = MODELS[args.model].micro_batch * PIPE_STAGES
    return (f" (pipeline: {PIPE_STAGES} stages x {args.nproc // PIPE_STAGES} replica(s), 1F1B, each replica's "
            f"batch of {rows} rows in m micro-batches of {rows}/m; v: chunks per stage, interleaved when > 1)")


def driver_main(args: argparse.Namespace) -> None:
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if base_system(s) not in ALL_SYSTEMS]
    if bad:
        raise SystemExit(f"--systems: unknown {bad}; valid choices: {', '.join(ALL_SYSTEMS)}")
    os.makedirs(args.ext_dir, exist_ok=True)
    skipped: dict[str, str] = {}
    if args.prepare or any(s.startswith("ds_") for s in systems):
        why = prepare_deepspeed(args)
        if why:
            print(f"DeepSpeed systems skipped: {why}", flush=True)
            skipped.update({s: why for s in systems if s.startswith("ds_")})
        if args.prepare:
            return
    for s in systems:
        base = base_system(s)
        if (base in ZT_STRATEGY or base in PIPE_SYSTEMS) and (why := zerotrain_skip(args, base)):
            skipped[s] = why
    for s, why in skipped.items():
        print(f"skipping {s}: {why}", flush=True)
    to_run = [s for s in systems if s not in skipped]

    spec = MODELS[args.model]
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpt_bench_")
    os.makedirs(workdir, exist_ok=True)
    print(f"model {args.model}: {spec.num_params() / 1e6:.1f}M params, {spec.n_layer} layers, d={spec.n_embd}, "
          f"seq {spec.block_size}, micro-batch {spec.micro_batch}/rank x {args.nproc} ranks; "
          f"precision {args.precision}; {args.warmup} warm-up + {args.steps} timed steps; "
          f"{args.repeats} repeat(s); logs in {workdir}", flush=True)
    results: dict[str, list[RunSummary]] = {s: [] for s in to_run}
    failures: dict[str, str] = {}
    for rep in range(args.repeats):  # interleaved: every system once, then every system again
        for s in to_run:
            if s in failures:
                continue
            out = run_system(args, s, rep, workdir)
            if isinstance(out, str):
                print(f"  {s:12s} rep {rep}: FAILED: {out}", flush=True)
                failures[s] = out
            else:
                results[s].append(out)
    table = render(args, {s: r for s, r in results.items() if r and s not in failures}, skipped, failures,
                   {s: PIPE_SYSTEMS[base_system(s)] for s in systems if base_system(s) in PIPE_SYSTEMS})
    info = machine_info()
    header = (f"### {args.model}, precision {args.precision}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n\n"
              f"`python -m zerotrain.bench.gpt_bench {shlex.join(sys.argv[1:])}`\n\n"
              f"CPU: {info['cpu']} ({info['cores']} cores); torch {info['torch']}, deepspeed {info['deepspeed']}; "
              f"{args.nproc} ranks x {args.threads} thread(s), gloo. Model: {spec.num_params() / 1e6:.1f}M params, "
              f"{spec.n_layer} layers, d={spec.n_embd}, seq {spec.block_size}, vocab {spec.vocab_size}, "
              f"micro-batch {spec.micro_batch}/rank{pipeline_note(args, to_run)}; data {args.data}; "
              f"{args.warmup} warm-up + {args.steps} "
              f"timed steps; median over {args.repeats} interleaved repeat(s)."
              f"{info['bf16_note'] if args.precision == 'bf16-mixed' else ''}\n\n")
    table += render_mfu(args, {s: r for s, r in results.items() if s not in failures}, spec)  # gpt_compiled.py
    print("\n" + header + table, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + header + table)
    if not failures and not any(r.exit_note for runs in results.values() for r in runs) and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt_21m")
    p.add_argument("--precision", choices=["32", "bf16-mixed"], default="32")
    p.add_argument("--data", choices=["stdlib", "random"], default="stdlib",
                   help="stdlib: the standard library's source as byte tokens; random: uniform token ids")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps run before the timed ones, not timed")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of every system")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list, in run order (default: all but {', '.join(PIPE_SYSTEMS)})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--out", help="append the table, the command, the date and the CPU to this markdown file")
    p.add_argument("--prepare", action="store_true", help="build DeepSpeed's shm_comm op into --ext-dir, exit")
    p.add_argument("--ext-dir", default=os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser(
        "~/.cache/zerotrain/torch_extensions"), help="TORCH_EXTENSIONS_DIR for DeepSpeed's op")
    p.add_argument("--timeout", type=int, default=1800, help="seconds before one run is killed")
    p.add_argument("--workdir", help="keep per-run logs and JSON here (default: a temp dir, removed on success)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one system on this rank
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "repeats", "nproc", "threads", "timeout"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
