"""The demo MoE GPT's step time with expert parallelism (ep=2: each rank holds half the experts,
tokens travel by all-to-all) against the same model with every expert on every rank (ep=1), under
DDP and zero2 on 2 ranks, and the all-to-all's share of the step, from the ResourceMonitor's
collective events (issue 46).

    # the measurement (bench/RESULTS.md): the 8-expert GPT on 2 quiet cores, ~5-10 min (a step took
    # 7-10 s on the shared machine of the smoke run)
    python -m zerotrain.bench.moe_bench --model moe_21m --steps 8 --warmup 2 --repeats 2 --out bench/RESULTS.md
    # its smoke run (tiny dims, seconds per case)
    python -m zerotrain.bench.moe_bench --model tiny --steps 2 --warmup 1 --repeats 1

Cases: ``ddp_ep1``, ``ddp_ep2``, ``zero2_ep1``, ``zero2_ep2`` (``--cases``). Each (case, repeat)
is its own Trainer job (``monitor_bench.driver`` and ``run_interleaved``: every case once, then again), one
thread per rank; a case's figure is the median over repeats of the mean over ranks. The same
seed gives every expert the same initial weights at ep=1 and ep=2 (``GPT.init_weights``) and
routing is per rank, so the two see the same tokens, drop the same ones and log the same losses:
the table's last column shows the final loss, which must agree across a row pair. "a2a ms": the
all-to-alls' time per step (each is blocking: issue to completion), "a2a share" its share of the
step.
"""
from __future__ import annotations

import argparse
import json
import statistics

from zerotrain.bench.monitor_bench import add_job_arguments, driver, run_interleaved  # noqa: F401

#: the MoE GPTs (GPTMoEConfig fields): moe_21m is the 21M benchmark GPT's shape (bench/common.py) with
#: byte tokens and an 8-expert MoE as the MLP of every other block (k=1, capacity factor 1.25)
MODELS = {
    "tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64, num_experts=4, micro_batch=2),
    "moe_21m": dict(block_size=256, n_layer=4, n_head=8, n_embd=512, num_experts=8, moe_every=2,
                    capacity_factor=1.25, micro_batch=4),
}
CASES = {"ddp_ep1": ("ddp", 1), "ddp_ep2": ("ddp", 2), "zero2_ep1": ("zero2", 1), "zero2_ep2": ("zero2", 2)}
SHOWN = ("step", "forward", "backward", "comm_wait", "optimizer")


def worker(args: argparse.Namespace) -> None:
    """One job: fit the MoE GPT under the case's strategy and ep_size; global rank 0 writes the summary."""
    from zerotrain import Trainer
    from zerotrain.callbacks import ResourceMonitor
    from zerotrain.examples.gpt import GPTMoEConfig
    from zerotrain.examples.gpt_module import GPTModule
    from zerotrain.strategies import strategy_from_name

    class A2AMonitor(ResourceMonitor):
        """The ResourceMonitor, plus each step's all-to-all time (the collective events it receives)."""

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.a2a: list[float] = []
            self._open: list = []  # this step's all-to-alls (t_done is set when one completes)

        def collective(self, event) -> None:
            super().collective(event)
            if event.op == "all_to_all" and self._timer is not None:
                self._open.append(event)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            steps = len(self.steps)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if len(self.steps) > steps:  # a step closed
                self.a2a.append(sum(e.t_done - e.t_issue for e in self._open if e.t_done is not None))
                self._open = []

    spec = dict(MODELS[args.model])
    batch = spec.pop("micro_batch")
    name, ep = CASES[args.case]
    module = GPTModule(GPTMoEConfig(**spec, ep_size=ep), batch_size=batch, max_steps=args.steps, warmup_steps=1,
                       val_fraction=0, max_bytes=2_000_000)
    monitor = A2AMonitor(warmup_steps=args.warmup, print_summary=False)
    trainer = Trainer(strategy=strategy_from_name(name), devices=args.nproc, accelerator="cpu", max_steps=args.steps,
                      callbacks=[monitor], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, seed=0)
    trainer.fit(module)
    kept = monitor.a2a[args.warmup:] or monitor.a2a
    a2a = trainer.strategy.reduce(sum(kept) / max(1, len(kept)), op="mean")  # collective: every rank
    if trainer.is_global_zero:
        rows = monitor.summary["rows"]
        out = {k: rows[k]["mean"] for k in SHOWN}
        out["a2a"] = float(a2a)
        out["loss"] = float(trainer.callback_metrics["train_loss"])
        with open(args.result, "w") as f:
            json.dump(out, f)


def run_case(args: argparse.Namespace, case: str, result: str) -> dict:
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "zerotrain.bench.moe_bench", "--worker", "--case", case, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--nproc", str(args.nproc), "--result", result]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, timeout=args.timeout)
    with open(result) as f:
        return json.load(f)


def render(args: argparse.Namespace, results: dict[str, list[dict]]) -> str:
    lines = [f"`python -m zerotrain.bench.moe_bench --model {args.model} --steps {args.steps} --warmup {args.warmup} "
             f"--repeats {args.repeats} --nproc {args.nproc}` (median over repeats of the mean over ranks)", "",
             "| case | " + " | ".join(f"{k} ms" for k in SHOWN) + " | a2a ms | a2a share | vs ep1 | final loss |",
             "|---|" + "---|" * (len(SHOWN) + 4)]
    med = {case: {k: statistics.median(r[k] for r in runs) for k in (*SHOWN, "a2a", "loss")}
           for case, runs in results.items()}
    for case, m in med.items():
        base = med.get(case.replace("_ep2", "_ep1"))
        ratio = f"{m['step'] / base['step']:.2f}" if base else "-"
        lines.append(f"| {case} | " + " | ".join(f"{m[k] * 1e3:.1f}" for k in SHOWN) +
                     f" | {m['a2a'] * 1e3:.1f} | {m['a2a'] / m['step']:.0%} | {ratio} | {m['loss']:.6f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="moe_21m", choices=tuple(MODELS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    add_job_arguments(p, timeout=1800)
    p.add_argument("--out", help="append the table to this Markdown file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    worker(args) if args.worker else driver(args, CASES, render, run_case)


if __name__ == "__main__":
    main()
