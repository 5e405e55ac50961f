"""ZeRO++'s quantized communication: what ``quantize_weights`` (qwZ) and ``quantize_gradients``
(qgZ) cost in accuracy and save in time and bytes, on 2 processes over gloo.

    python -m zerotrain.bench.zeropp_bench --part losses --steps 300
    python -m zerotrain.bench.zeropp_bench --part speed --model gpt_118m --steps 12 --warmup 2 --repeats 2

``--part losses``: the demo GPT (``GPTModule``'s default shape: 4 layers, d=256, byte tokens, the
stdlib corpus) for ``--steps`` steps under zero3 exact (fp32 communication), zero3 with qwZ, with
qgZ, with both, and zero2 with qgZ against zero2 exact
(``--cases nvme,nvme_bf16,nvme_bf16grads,nvme_bf16params,nvme_bf16all``:
ZeRO-3 with NVMe offload, its Adam moments in bf16, those with the gradients on disk, bf16
parameter files, and bf16 moments with bf16 parameter files, against the fp32-state run). Reported: each run's final loss (mean of
the last 10 steps, rank 0's micro-batches) and its relative distance to the exact run of its stage
(the issue's bound: within 1%), and the largest per-step distance.

``--part speed``: ``--model`` (``bench/common.py``: gpt_118m is model B) under ddp, zero3, zero3 +
qwZ, zero3 + qgZ and zero3 + both, and zero3 alone and with both keeping every unit gathered from
forward to backward (``max_reuse_distance``); per case the median step time (the ResourceMonitor's mean over
the timed steps, slowest rank), its ratio to ddp in the same round, and the bytes per step of each
collective (the CommsLogger). Cases run interleaved (every case once, then every case again); a
figure is the median over repeats. Timings need a quiet machine.

Each (case, repeat) is its own job: this file with ``--worker`` runs ``Trainer.fit`` with
``devices=--nproc`` (the Trainer launches its ranks); rank 0 writes a JSON result.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from zerotrain.bench.monitor_bench import add_job_arguments, run_interleaved

LOSS_CASES = {
    "zero3": ("zero3", {}),
    "zero3_qw": ("zero3", {"quantize_weights": True}),
    "zero3_qg": ("zero3", {"quantize_gradients": True}),
    "zero3_qwqg": ("zero3", {"quantize_weights": True, "quantize_gradients": True}),
    "zero2": ("zero2", {}),
    "zero2_qg": ("zero2", {"quantize_gradients": True}),
}
#: issue 17's loss check (not run by default: ``--cases nvme,nvme_bf16,...``): ZeRO-3 with
#: Adam state and parameter shards on NVMe, fp32 compute; the moments in bf16 (stochastically
#: rounded); bf16 moments with the gradient partition on disk too (bit for bit the run before); bf16
#: parameter files beside the fp32 master (param_dtype), alone and with bf16 moments
_NVME = {"stage": 3, "param_device": "nvme"}
OFFLOAD_CASES = {
    "nvme": ("offload_nvme", _NVME),
    "nvme_bf16": ("offload_nvme", {**_NVME, "optimizer_state_dtype": "bf16"}),
    "nvme_bf16grads": ("offload_nvme", {**_NVME, "optimizer_state_dtype": "bf16", "grad_device": "nvme"}),
    "nvme_bf16params": ("offload_nvme", {**_NVME, "param_dtype": "bf16"}),
    "nvme_bf16all": ("offload_nvme", {**_NVME, "optimizer_state_dtype": "bf16", "param_dtype": "bf16"}),
}
SPEED_CASES = {
    "ddp": ("ddp", {}),
    "zero3": ("zero3", {}),
    "zero3_qw": ("zero3", {"quantize_weights": True}),
    "zero3_qg": ("zero3", {"quantize_gradients": True}),
    "zero3_qwqg": ("zero3", {"quantize_weights": True, "quantize_gradients": True}),
    # every unit kept gathered from its forward to its backward (within max_live_parameters'
    # default 1e9 elements): one gather per unit and step instead of two
    "zero3_reuse": ("zero3", {"max_reuse_distance": 10**9}),
    "zero3_qwqg_reuse": ("zero3", {"quantize_weights": True, "quantize_gradients": True, "max_reuse_distance": 10**9}),
}
CASES = {**LOSS_CASES, **OFFLOAD_CASES, **SPEED_CASES}
TAIL = 10  # steps averaged for the final loss


def worker(args: argparse.Namespace) -> None:
    """One job: fit under the case's strategy; global rank 0 writes losses, timings and bytes."""
    from zerotrain import Callback, Trainer
    from zerotrain.bench.common import MODELS
    from zerotrain.callbacks import CommsLogger, ResourceMonitor
    from zerotrain.examples.gpt_module import GPTModule
    from zerotrain.strategies import strategy_from_name

    class Losses(Callback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.values.append(float((outputs["loss"] if isinstance(outputs, dict) else outputs).detach()))

    name, options = CASES[args.case]
    if args.case in OFFLOAD_CASES:  # swap files beside the result (each rank makes its own folder)
        options = {**options, "nvme_path": os.path.join(os.path.dirname(os.path.abspath(args.result)),
                                                        f"nvme_{args.case}")}
    if args.part == "losses":
        # the demo GPT and its data (its default 20 warm-up steps, fewer in a shorter smoke run)
        module = GPTModule(max_steps=args.steps, warmup_steps=min(20, args.steps), val_fraction=0)
    else:
        spec = MODELS[args.model]
        module = GPTModule(spec.config(), batch_size=spec.micro_batch, max_steps=args.steps, warmup_steps=1,
                           val_fraction=0, max_bytes=2_000_000)
    losses, comms = Losses(), CommsLogger()
    monitor = ResourceMonitor(warmup_steps=args.warmup, print_summary=False)
    trainer = Trainer(strategy=strategy_from_name(name, **options), devices=args.nproc, accelerator="cpu",
                      max_steps=args.steps, callbacks=[losses, comms, monitor], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, seed=0)
    trainer.fit(module)
    if trainer.is_global_zero:
        with open(args.result, "w") as f:
            json.dump({"losses": losses.values, "step_s": monitor.summary["rows"]["step"]["mean"],
                       "bytes": comms.expected}, f)


def run_case(args: argparse.Namespace, case: str, result: str) -> dict:
    cmd = [sys.executable, "-m", "zerotrain.bench.zeropp_bench", "--worker", "--part", args.part, "--case", case,
           "--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--nproc", str(args.nproc), "--result", result]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
    with open(result) as f:
        return json.load(f)


def render_losses(results: dict[str, list[dict]]) -> str:
    lines = ["| case | final loss (last 10 steps) | vs exact | largest per-step relative difference |",
             "|---|---|---|---|"]
    for case, runs in results.items():
        got = runs[0]["losses"]
        if case.split("_")[0] not in results:
            lines.append(f"| {case} | {statistics.fmean(got[-TAIL:]):.4f} | (exact run not in --cases) | |")
            continue
        exact = results[case.split("_")[0]][0]["losses"]
        final, ref = statistics.fmean(got[-TAIL:]), statistics.fmean(exact[-TAIL:])
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, exact))
        lines.append(f"| {case} | {final:.4f} | {(final - ref) / ref:+.3%} | {worst:.2e} |")
    return "\n".join(lines)


def render_speed(results: dict[str, list[dict]]) -> str:
    lines = ["| case | step ms | x ddp | bytes per step by collective |", "|---|---|---|---|"]
    ddp = statistics.median(r["step_s"] for r in results["ddp"])
    for case, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        by_op = ", ".join(f"{op} {n / 1e6:.1f} MB" for op, n in sorted(runs[0]["bytes"].items()))
        lines.append(f"| {case} | {step * 1e3:.1f} | {step / ddp:.2f} | {by_op} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("losses", "speed"), default="losses")
    p.add_argument("--model", default="gpt_118m", help="--part speed: a bench/common.py MODELS key")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=2, help="steps the ResourceMonitor does not time")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cases", default="", help="comma list (default: every case of the part)")
    add_job_arguments(p, timeout=7200.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    cases = [c for c in args.cases.split(",") if c] or list(LOSS_CASES if args.part == "losses" else SPEED_CASES)
    results = run_interleaved(args, cases, run_case)
    command = "python -m zerotrain.bench.zeropp_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    table = render_losses(results) if args.part == "losses" else render_speed(results)
    print(f"`{command}`\n\n{table}")


if __name__ == "__main__":
    main()
