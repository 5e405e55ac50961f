"""The longest sequence one training step fits in under a per-rank memory cap: the 118M GPT on 2
processes, data parallel (dp=2: each rank holds whole sequences) against Ulysses sequence
parallelism (dp=1 x sp=2: each rank holds half of one sequence; issue 45).

    python -m zerotrain.bench.long_context --out bench/RESULTS.md    # the search at 9 GiB/rank (an hour or more)
    python -m zerotrain.bench.long_context --cap-gib 4 --max-probes 4 --out bench/RESULTS.md   # ~12 min
    python -m zerotrain.bench.long_context --dry-run                  # the tiny GPT, a few s per probe

A probe is one ``torchrun --standalone --nproc_per_node 2`` job of this file's worker: the Trainer
under ``DDP(sequence_parallel=1 or 2)`` runs ONE step (forward, backward, AdamW step) on a micro-batch
of one sequence of ``length`` tokens (random ids; the GPT built with ``block_size=length``; under sp
the module attends through ``ulysses_attention`` and returns ``sequence_loss``). It passes when every
rank finishes the step and its peak RSS (the kernel's ``VmHWM``) stays within ``--cap-gib``. The
driver watches every rank's RSS every 20 ms and kills the job above the cap, so the machine never
holds more than ranks x cap for it; before each probe it waits until that much memory is available.

The search per mode (``long_context_search.py``): two short calibration probes (``--calib``) fit
peak RSS = a + b * length (the table's "predicted" is where it crosses the cap); the next probes
follow the line through the two longest lengths that fit, at most doubling before the first
failure (short lengths peak at the optimizer step, not in the activations, so the calibration's
line can be flat), then inside the bracket (longest pass, shortest failure); at most
``--max-probes`` of them, none started after ``--budget-min``.

``--precision auto``: bf16-mixed unless a 1024^3 bf16 matmul on one thread is more than
``BF16_SLOWDOWN_MAX`` times slower than fp32's (no AVX512-BF16 or AMX); the header records both.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from zerotrain.bench.long_context_search import GiB, MODES, add_summary_row, render, search, summary_row

NPROC = 2
BF16_SLOWDOWN_MAX = 2.0


def proc_kib(path: str, key: str) -> int:
    """A ``kB`` field of a /proc file (``/proc/self/status``, ``/proc/meminfo``) in bytes."""
    with open(path) as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key + ":"))


def train_one_step(args: argparse.Namespace, rank: int) -> dict:
    import torch
    import torch.nn.functional as F

    from zerotrain import Callback, Trainer, TrainModule
    from zerotrain.bench.common import MODELS, build_gpt, make_adamw
    from zerotrain.strategies import strategy_from_name
    from zerotrain.strategies.parallel import ulysses_attention

    sp = MODES[args.worker]
    spec = dataclasses.replace(MODELS[args.model], block_size=args.length)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + (0 if sp > 1 else rank))  # sp: one shared batch
    tok = torch.randint(spec.vocab_size, (1, args.length + 1), generator=g)
    out: dict = {}

    class LongModule(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.attends = None, False

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build_gpt(spec.config(), args.seed, spec.tied)

        def training_step(self, batch, batch_idx):
            s = self.trainer.strategy
            if not self.attends and s.mesh_size("sequence") > 1:
                group = s.mesh_group("sequence")
                self.model.use_attention(lambda q, k, v: ulysses_attention(q, k, v, group))
                self.attends = True
            ids, targets = batch  # this rank's shard of the sequence under sp
            logits, _ = self.model(ids, positions=s.sequence_positions(ids.shape[1]))
            loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            return s.sequence_loss(loss_sum, targets.numel())

        def configure_optimizers(self):
            return make_adamw(self)[0]

    class StepTimer(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            out["rss_before_step"] = proc_kib("/proc/self/status", "VmRSS")
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            out.update(step_s=time.perf_counter() - self.start, loss=float(outputs["loss"]))

    trainer = Trainer(accelerator="cpu", devices=NPROC, strategy=strategy_from_name("ddp", sequence_parallel=sp),
                      precision=args.precision, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, callbacks=[StepTimer()], log_every_n_steps=10**9, seed=args.seed,
                      default_root_dir=args.result_dir, stall_timeout_s=None)  # one step of minutes: no stall watch
    trainer.fit(LongModule(), train_dataloaders=[(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())])
    return out


def worker_main(args: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    out: dict = {"rank": rank, "ok": False}
    try:
        out.update(train_one_step(args, rank), ok=True)
    except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as RuntimeError
        out["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    out["peak_rss"] = proc_kib("/proc/self/status", "VmHWM")
    with open(os.path.join(args.result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if not out["ok"]:
        os._exit(3)  # a peer may wait in a collective: torchrun ends it


# =============================================================================== driver side
def matmul_speeds() -> dict[str, float]:
    """GFLOP/s of one 1024^3 matmul on one thread, fp32 and bf16 (best of 3 after a warm-up)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        times = []
        for _ in range(4):  # a warm-up, then the best of 3
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        out[name] = 2 * 1024**3 / min(times[1:]) / 1e9
    torch.set_num_threads(threads)
    return out


def wait_for_memory(need: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while (avail := proc_kib("/proc/meminfo", "MemAvailable")) < need:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {avail / GiB:.1f} GiB available, {need / GiB:.1f} needed (ranks x cap + 2); "
                             f"waited {wait_s:.0f} s (--mem-wait)")
        print(f"  waiting: {avail / GiB:.1f} GiB available, {need / GiB:.1f} needed", flush=True)
        time.sleep(10)


def run_probe(args: argparse.Namespace, mode: str, length: int, *, workdir: str, cap: int) -> dict:
    """One torchrun job of the worker under the RSS watch; {ok, peak, step_s, why, wall_s}."""
    import psutil

    result_dir = os.path.join(workdir, f"{mode}_{length}")
    os.makedirs(result_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
           "-m", "zerotrain.bench.long_context", "--worker", mode, "--length", str(length), "--model", args.model,
           "--precision", args.precision, "--seed", str(args.seed), "--result-dir", result_dir]
    wait_for_memory(NPROC * cap + 2 * GiB, args.mem_wait)
    start, why, seen, ranks = time.monotonic(), None, 0, []
    with open(result_dir + ".log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        while proc.poll() is None and why is None:
            if len(ranks) < NPROC:  # torchrun's workers, each in a session of its own
                with contextlib.suppress(psutil.Error):
                    ranks = psutil.Process(proc.pid).children(recursive=True)
            for p in ranks:
                with contextlib.suppress(psutil.Error):
                    seen = max(seen, p.memory_info().rss)
            if seen > cap:
                why = f"RSS {seen / GiB:.2f} GiB > cap (killed)"
            elif time.monotonic() - start > args.timeout:
                why = "timeout"
            time.sleep(0.02)
        for p in ranks if proc.poll() is None else []:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    if why == "timeout":
        raise SystemExit(f"probe {mode} {length} timed out after {args.timeout} s (--timeout; log: {result_dir}.log)")
    files = [os.path.join(result_dir, f"rank{r}.json") for r in range(NPROC)]
    records = [json.loads(pathlib.Path(f).read_text()) for f in files if os.path.exists(f)]
    peak = max([seen] + [r["peak_rss"] for r in records])
    memory = ("memory", "alloc", "> cap")
    errors = sorted((r["error"] for r in records if r.get("error")), key=lambda e: not any(k in e.lower() for k in memory))
    ok = why is None and rc == 0 and len(records) == NPROC and all(r["ok"] for r in records) and peak <= cap
    if not ok and why is None:
        why = errors[0] if errors else f"peak RSS {peak / GiB:.2f} GiB > cap" if peak > cap else f"exit code {rc}"
        if not any(k in why.lower() for k in memory) and peak < 0.9 * cap:
            raise SystemExit(f"probe {mode} {length} failed, not for memory: {why} (log: {result_dir}.log)")
    row = {"mode": mode, "length": length, "ok": ok, "peak": peak, "why": why, "wall_s": time.monotonic() - start,
           "step_s": max((r.get("step_s", 0.0) for r in records), default=0.0)}
    print(f"  {mode} {length:6d}: {'fits' if ok else 'FAILS'}, peak {peak / GiB:.2f} GiB/rank, "
          f"step {row['step_s']:.1f} s, wall {row['wall_s']:.0f} s{'' if ok else ': ' + str(why)}", flush=True)
    return row


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()


def driver_main(args: argparse.Namespace) -> None:
    from zerotrain.bench.gpt_bench import machine_info

    cap = int(args.cap_gib * GiB)
    speeds = matmul_speeds()
    if args.precision == "auto":
        args.precision = "bf16-mixed" if speeds["fp32"] / speeds["bf16"] <= BF16_SLOWDOWN_MAX else "32"
    info, started = machine_info(), datetime.datetime.now(datetime.timezone.utc)
    note = (f"1024^3 matmul on one thread: fp32 {speeds['fp32']:.0f} GFLOP/s, bf16 {speeds['bf16']:.0f} GFLOP/s "
            f"-> precision {args.precision}")
    print(f"{args.model}, cap {args.cap_gib} GiB/rank, {NPROC} ranks x 1 thread; {note}", flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="long_context_")
    rows = [search(mode, functools.partial(run_probe, args, mode, workdir=workdir, cap=cap), args.calib, cap,
                   args.grain, args.max_len, args.max_probes, args.budget_min * 60) for mode in args.modes]
    table = render(rows, cap)
    cmd = "python -m zerotrain.bench.long_context " + shlex.join(sys.argv[1:])
    title = f"Longest trainable sequence, {args.model}, dp=2 vs sp=2 ({started:%Y-%m-%d %H:%M} UTC)"
    header = (f"### {title}\n\n"
              f"`{cmd}`\n\nCPU: {info['cpu']} ({info['cores']} cores), torch {info['torch']}, commit {_commit()}; "
              f"{NPROC} ranks x 1 thread over gloo, the Trainer's `DDP(sequence_parallel=1 / 2)`, micro-batch 1, "
              f"one step (forward, backward, fused AdamW), random token ids, the GPT built with block_size = "
              f"the length; {note}. A probe fits when both ranks finish the step with peak RSS (VmHWM, "
              f"imports included) within {args.cap_gib} GiB; step s: the slowest rank's, on a shared machine "
              f"(not a speed figure). Logs: {workdir}\n\n")
    print("\n" + header + table, flush=True)
    if args.out:
        with open(args.out) as f:
            text = f.read()
        what = f"Longest trainable sequence ({args.model}), 2 ranks, one step, {args.precision}, cap {args.cap_gib} GiB/rank"
        row = summary_row(rows, what, f"{started:%Y-%m-%d %H:%M}, {_commit()}, {info['cpu']}", title)
        with open(args.out, "w") as f:
            f.write(add_summary_row(text, row).rstrip("\n") + "\n\n" + header + table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt_118m", help="a bench/common.py MODELS size (its block_size is replaced)")
    p.add_argument("--modes", default="dp2,sp2", help="comma list of: " + ", ".join(MODES))
    p.add_argument("--cap-gib", type=float, default=9.0, help="peak RSS allowed per rank")
    p.add_argument("--calib", default="1024,2048", help="the two short lengths of the per-token model")
    p.add_argument("--grain", type=int, default=512, help="lengths probed are multiples of this")
    p.add_argument("--max-probes", type=int, default=4, help="probes after calibration, per mode")
    p.add_argument("--max-len", type=int, default=131072)
    p.add_argument("--budget-min", type=float, default=float("inf"), help="per mode: no probe starts after this")
    p.add_argument("--precision", choices=["auto", "32", "bf16-mixed"], default="auto")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=int, default=1200, help="seconds before one probe is killed")
    p.add_argument("--mem-wait", type=float, default=600, help="seconds to wait for ranks x cap + 2 GiB of free memory")
    p.add_argument("--out", help="append the tables to this markdown file and its summary row")
    p.add_argument("--workdir", help="probe logs and JSON here (default: a new temp dir, kept)")
    p.add_argument("--dry-run", action="store_true", help="the tiny GPT, lengths 128/256, grain 128, up to 1024")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.dry_run:
        args.model, args.calib, args.grain, args.max_len, args.max_probes = "tiny", "128,256", 128, 1024, 2
    from zerotrain.bench.common import MODELS

    if args.model not in MODELS:
        p.error(f"--model={args.model!r}: valid choices: {', '.join(sorted(MODELS))}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes={','.join(args.modes)!r}: valid: a comma list of {', '.join(MODES)}")
    try:
        args.calib = sorted({int(n) for n in args.calib.split(",")})
    except ValueError:
        args.calib = []
    bad = [(f"--cap-gib={args.cap_gib}", "0 < cap <= 10 (2 ranks share a 24 GiB machine)", not 0 < args.cap_gib <= 10),
           (f"--grain={args.grain}", "an even number >= 2 (sp=2 halves the sequence)", args.grain < 2 or args.grain % 2),
           (f"--calib={args.calib}", f"two different positive multiples of --grain={args.grain}",
            len(args.calib) != 2 or any(n <= 0 or n % args.grain for n in args.calib)),
           (f"--max-len={args.max_len}", "at least the longest --calib length", args.max_len < max(args.calib, default=0)),
           (f"--max-probes={args.max_probes}", ">= 0", args.max_probes < 0)]
    for what, valid, wrong in bad:
        if wrong:
            p.error(f"{what}: valid: {valid}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    (worker_main if args.worker else driver_main)(args)


if __name__ == "__main__":
    main()
