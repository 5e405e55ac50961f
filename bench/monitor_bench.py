"""Where a step's time goes, by strategy: the ResourceMonitor's breakdown of the benchmark GPT
(``--model gpt_21m``: 4 layers, d=512, seq 256, micro-batch 4/rank) under ddp, zero2, zero3 and
zero3 with prefetch off, on ``--nproc`` processes over gloo.

The case to look at is zero3 with and without prefetch: with prefetch the all-gather of the next
unit runs while the current one computes, so the comm-wait share of the step is small and the
communication shows up as ``comm_overlapped``; with ``prefetch_bucket_size=0`` every unit's gather
is waited for in full before its forward and backward, and comm wait becomes a large share.

    python -m zerotrain.bench.monitor_bench --model gpt_21m --steps 12 --warmup 2 --repeats 2

Each (case, repeat) is its own job (the Trainer launches its ranks), run interleaved: every case
once, then every case again; a case's figure is the median over repeats. Timings need a quiet
machine: on a shared one the shares still separate the cases, the absolute times do not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

CASES = {
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "zero3_reuse": ("zero3", {"max_reuse_distance": 10**9}),
    "zero3_no_prefetch": ("zero3", {"prefetch_bucket_size": 0}),
}
SHOWN = ("step", "data", "forward", "backward", "comm_wait", "optimizer", "refresh", "other", "comm_overlapped")


def worker(args: argparse.Namespace) -> None:
    """One job: fit the model under the case's strategy; global rank 0 writes the summary."""
    from zerotrain import Trainer
    from zerotrain.bench.common import MODELS
    from zerotrain.callbacks import Callback, ResourceMonitor
    from zerotrain.examples.gpt_module import GPTModule
    from zerotrain.strategies import strategy_from_name

    class WallClock(Callback):
        """Each optimizer step's wall time on ``time.monotonic`` (the breakdown uses
        ``perf_counter``), step end to step end: what the breakdown's parts must add up to."""

        def __init__(self) -> None:
            self.walls: list[float] = []
            self._last, self._step = 0.0, 0

        def on_train_start(self, trainer, module) -> None:
            self._last, self._step = time.monotonic(), trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step != self._step:
                now = time.monotonic()
                self.walls.append(now - self._last)
                self._last, self._step = now, trainer.global_step

    spec = MODELS[args.model]
    name, options = CASES[args.case]
    batch_size = spec.micro_batch if args.micro_batch is None else args.micro_batch
    module = GPTModule(spec.config(), batch_size=batch_size, max_steps=args.steps, warmup_steps=1,
                       val_fraction=0, max_bytes=2_000_000)
    monitor = ResourceMonitor(warmup_steps=args.warmup, print_summary=True)
    clock = WallClock()  # after the monitor: it reads the other clock right after each step closes
    trainer = Trainer(strategy=strategy_from_name(name, **options), devices=args.nproc, accelerator="cpu",
                      max_steps=args.steps, callbacks=[monitor, clock], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, seed=0)
    trainer.fit(module)
    if trainer.is_global_zero:
        rows = monitor.summary["rows"]
        out = {k: {"mean": rows[k]["mean"], "share": rows[k]["share"]} for k in SHOWN}
        # this rank's timed steps by the breakdown (sum of its parts) and by the other clock
        parts = [r["step"] for r in monitor.steps[args.warmup:]]
        walls = clock.walls[args.warmup:]
        out["check"] = {"parts_sum": sum(parts), "wall": sum(walls), "steps": len(walls)}
        with open(args.result, "w") as f:
            json.dump(out, f)



def run_case(args: argparse.Namespace, case: str, result: str) -> dict:
    cmd = [sys.executable, "-m", "zerotrain.bench.monitor_bench", "--worker", "--case", case, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nproc", str(args.nproc), "--result", result]
    if args.micro_batch is not None:
        cmd += ["--micro-batch", str(args.micro_batch)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, env=env, timeout=args.timeout)
    with open(result) as f:
        return json.load(f)


def render(args: argparse.Namespace, results: dict[str, list[dict]]) -> str:
    head = "| case | " + " | ".join(f"{k} ms (share)" if k != "step" else "step ms" for k in SHOWN) + " |"
    mb = "" if args.micro_batch is None else f" --micro-batch {args.micro_batch}"
    lines = [f"`python -m zerotrain.bench.monitor_bench --model {args.model}{mb} --steps {args.steps} --warmup "
             f"{args.warmup} --repeats {args.repeats} --nproc {args.nproc}` (median over repeats, mean over ranks; "
             "comm_overlapped is not part of the step's sum)", "", head, "|" + "---|" * (len(SHOWN) + 1)]
    for case, runs in results.items():
        cells = []
        for k in SHOWN:
            ms = statistics.median(r[k]["mean"] for r in runs) * 1e3
            share = statistics.median(r[k]["share"] for r in runs)
            cells.append(f"{ms:.1f}" if k == "step" else f"{ms:.1f} ({share:.0%})")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    checks = [(case, r["check"]) for case, runs in results.items() for r in runs if "check" in r]
    if checks:
        lines += ["", "Does the breakdown add up? Rank 0's timed steps, the sum of the parts against the wall time "
                  "between step ends on another clock (`time.monotonic`):", "",
                  "| case | repeat | steps | parts sum (s) | wall (s) | parts / wall |", "|---|---|---|---|---|---|"]
        seen: dict[str, int] = {}
        for case, c in checks:
            seen[case] = seen.get(case, 0) + 1
            lines.append(f"| {case} | {seen[case]} | {c['steps']} | {c['parts_sum']:.3f} | {c['wall']:.3f} | "
                         f"{c['parts_sum'] / c['wall']:.4f} |")
    return "\n".join(lines)


def run_interleaved(args: argparse.Namespace, cases: list[str],
                    run: Callable[[argparse.Namespace, str, str], dict]) -> dict[str, list[dict]]:
    """Every case once, then every case again (``args.repeats`` rounds), so the machine's drift
    hits all alike; ``run(args, case, result_path)`` is one job. Case -> its results in order."""
    results: dict[str, list[dict]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for case in cases:
                results[case].append(run(args, case, os.path.join(tmp, f"{case}_{rep}.json")))
    return results


def driver(args: argparse.Namespace, known: dict = CASES, render: Callable = render, run: Callable = run_case) -> None:
    """Every case of ``--cases`` (each one of ``known``) by ``run``, interleaved; the table by ``render``
    printed and appended to ``--out`` (moe_bench.py passes its own three)."""
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in known]
    if unknown:
        raise SystemExit(f"--cases={args.cases!r}: {unknown} unknown; valid: {', '.join(known)}")
    table = render(args, run_interleaved(args, cases, run))
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt_21m", choices=("tiny", "gpt_21m", "gpt_118m"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank and step (default: the model's, bench/common.py); fewer make "
                        "compute smaller beside the same communication")
    add_job_arguments(p, timeout=1800)
    p.add_argument("--out", help="append the table to this Markdown file")
    return p.parse_args(argv)


def add_job_arguments(p: argparse.ArgumentParser, timeout: float) -> None:
    """The options of a driver that runs each case as its own Trainer job (``run_interleaved``),
    and the hidden ones the driver passes to the job."""
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per rank (OMP_NUM_THREADS)")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds per job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
