"""Does ``zerotrain-tune`` pick well? The bench command (about 27 minutes on a quiet 2-core machine,
55 on a machine half as fast)::

    python -m zerotrain.bench.tune_sweep --out /tmp/tune_sweep --sweep-repeats 2 --sweep-steps 4 \
        --tune-repeats 2 --tune-steps 4 --keep-within 0.05

(four timed steps per run, after one warm-up step: with two, two runs of a configuration can
differ by more than the configurations do)

Its pick against an exhaustive sweep of the same space on the benchmark GPT (``model=gpt_21m
model.vocab_size=16384``: 21.1M parameters, 4 layers, d=512, seq 256, 4 sequences per rank and
optimizer step, as ``gpt_bench``), 2 processes, fp32:

1. the sweep: every configuration of the space (5 strategies x micro-batch 4 or 2+2 accumulated x
   2 bucket sizes, and zero3 with and without activation checkpointing: 24), ``--sweep-repeats``
   interleaved runs each, no racing, nothing pruned (the machine's memory holds them all);
2. ``zerotrain-tune`` itself with its racing (``--tune-repeats``, ``--keep-within``);
3. a cap that excludes ddp, set from the estimator's numbers (between ddp's lowest estimate and
   the lowest of zero2's and zero3's, with the margin): which configurations the estimate prunes,
   whether the sweep shows any of them fitting the cap after all, and a real ``zerotrain-tune``
   under that cap on a small space (ddp, zero2, zero3), whose pick then trains through
   ``zerotrain-train --config-dir ... +tuned=capped``. A configuration *fits* when its measured
   peak RSS with the tuner's margin of headroom is under the cap (the margin is what the tuner
   promises to leave free); one pruned although it fits is a wrong prune, and one measured under
   the cap but without that headroom is listed apart.

It prints a Markdown section for ``bench/RESULTS.md``: the pick against the sweep's best (in %)
and against the default configuration (ddp, micro-batch 4, default buckets), and the pruning's
check. The expected duration is printed first (runs start in ~10 s and a step takes ~2 s);
``--smoke`` checks the script on the tiny GPT and 3 configurations in a few minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: the benchmark model and batch; --smoke swaps in the tiny one
MODEL = ["model=gpt_21m", "model.vocab_size=16384", "data.batch_size=4", "data.max_bytes=400000"]
SMOKE = ["model=gpt_tiny", "data.batch_size=4", "data.max_bytes=100000"]
COMMON = ["trainer.devices=2", "precision=32"]
#: --smoke: 3 configurations (ddp, zero3 with and without checkpointing) instead of the whole space
SMOKE_SPACE = ["--strategies", "ddp,zero3", "--micro-batches", "4", "--bucket-scales", "1"]
#: quiet 2-core figures behind the printed expectation (bench/RESULTS.md: ddp 2.07 s/step at
#: micro-batch 4; a run's start, imports and process group, ~10 s)
STEP_S, START_S = 2.1, 10.0


def _tune(args: argparse.Namespace, out: str, *options: str, allow_none: bool = False) -> dict:
    """One ``zerotrain-tune`` command; returns its ``tune_results.json``."""
    model = SMOKE if args.smoke else MODEL
    cmd = [sys.executable, "-m", "zerotrain.tune", "--out", out, *options, *model, *COMMON]
    print("$ " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, text=True)
    path = os.path.join(out, "tune_results.json")
    if proc.returncode == 1 and allow_none:  # nothing fitted: the capped case reports it
        return json.load(open(path)) if os.path.exists(path) else {"winner": None, "results": []}
    if proc.returncode != 0:
        raise SystemExit(f"tune_sweep: {' '.join(cmd[1:])} ended with exit code {proc.returncode}")
    with open(path) as f:
        return json.load(f)


def expected_seconds(configs: int, args: argparse.Namespace) -> float:
    per_sweep = START_S + (1 + args.sweep_steps) * STEP_S
    per_tune = START_S + (1 + args.tune_steps) * STEP_S
    # the tune's second and later rounds: about a sixth of the space stays within --keep-within
    tune_runs = configs + max(1, configs // 6) * (args.tune_repeats - 1)
    return configs * args.sweep_repeats * per_sweep + tune_runs * per_tune + 2 * per_tune


def _best(rows: list[dict], fits=lambda r: True) -> dict:
    timed = [r for r in rows if r["median_step_s"] is not None and fits(r)]
    return min(timed, key=lambda r: r["median_step_s"])


def _need(row: dict, margin: float) -> float:
    return row["estimate"]["total"] * (1 + margin)


#: the strategies of the capped run: the cap excludes the first, keeps at least one of the others
CAPPED = ("ddp", "zero2", "zero3")


def cap_excluding_ddp(rows: list[dict], margin: float) -> float:
    """Between ddp's lowest estimate (with the margin) and the lowest of the capped run's sharded
    strategies: every ddp configuration is pruned, at least one sharded configuration is kept."""
    ddp = min(_need(r, margin) for r in rows if r["candidate"]["strategy"] == "ddp")
    sharded = min(_need(r, margin) for r in rows if r["candidate"]["strategy"] in CAPPED[1:])
    if sharded >= ddp:
        raise SystemExit(f"tune_sweep: the sharded strategies' lowest estimate {sharded:.0f} B is not below "
                         f"ddp's {ddp:.0f} B")
    return (ddp + sharded) / 2


def section(sweep: dict, tune: dict, capped: dict, cap: float, trained: bool, elapsed: float) -> str:
    rows = {r["label"]: r for r in sweep["results"]}
    best, pick, default = _best(sweep["results"]), rows[tune["winner"]], rows.get(sweep["default"])
    margin = sweep["margin"]
    pruned = [r for r in sweep["results"] if _need(r, margin) > cap]
    def measured(r: dict, headroom: float) -> bool:  # its measured peak, with headroom, under the cap
        return bool(r["peak_rss"]) and max(r["peak_rss"]) * (1 + headroom) <= cap

    false = [r for r in pruned if measured(r, margin)]  # fitted with the margin's headroom: a wrong prune
    band = [r for r in pruned if measured(r, 0) and not measured(r, margin)]  # under the cap, not the headroom
    under = [r for r in sweep["results"] if measured(r, margin)]
    lines = [f"### zerotrain-tune against an exhaustive sweep, {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"`python -m zerotrain.bench.tune_sweep {' '.join(sys.argv[1:])}` ({elapsed / 60:.1f} min, of which the sweep "
             f"{sweep['elapsed_s'] / 60:.1f} min). Overrides: "
             f"`{' '.join(sweep['overrides'])}`; {len(rows)} configurations; sweep: median of "
             f"{len(best['step_s'])} interleaved runs each.", "",
             "| | configuration | step (s), sweep | vs sweep's best |", "|---|---|---|---|"]
    for name, r in (("sweep's best", best), ("zerotrain-tune's pick", pick), ("default", default)):
        if r is not None:
            lines.append(f"| {name} | {r['label']} | {r['median_step_s']:.3f} | "
                         f"{r['median_step_s'] / best['median_step_s'] - 1:+.1%} |")
    if default is not None:
        lines += ["", f"The pick's step time against the default configuration's (sweep figures): "
                  f"{pick['median_step_s'] / default['median_step_s'] - 1:+.1%} (negative: the pick is faster)."]
    lines += ["", f"Cap excluding ddp, from the estimator: {cap / 2**30:.3f} GiB per rank (margin {margin:.0%}). "
              f"Pruned by the estimate: {len(pruned)} ({', '.join(r['label'] for r in pruned)}). "
              f"Pruned although the sweep measured them under the cap with the {margin:.0%} headroom "
              f"(wrong prunes): {len(false)}" + (f" ({', '.join(r['label'] for r in false)})" if false else "")
              + f"; pruned and measured under the cap but within the headroom: {len(band)}"
              + (f" ({', '.join(r['label'] for r in band)})" if band else "") + ". "
              f"Measured under the cap with the headroom in the sweep: {len(under)}; fastest of them: "
              + (_best(under)["label"] if under else "none") + ".",
              f"zerotrain-tune under that cap (small space) picked {capped['winner']}; "
              f"zerotrain-train with `+tuned=capped` {'ran' if trained else 'did not run'}.", "",
              "| configuration | sweep step (s) | sweep peak RSS/rank (GiB) | estimate (GiB) | + margin | estimate / peak |",
              "|---|---|---|---|---|---|"]
    for r in sorted(sweep["results"], key=lambda r: r["median_step_s"] or 1e9):
        step = f"{r['median_step_s']:.3f}" if r["median_step_s"] is not None else r["status"]
        lines.append(f"| {r['label']} | {step} | " + ("/".join(f"{b / 2**30:.3f}" for b in r["peak_rss"]) or "-")
                     + f" | {_need(r, 0) / 2**30:.3f} | {_need(r, margin) / 2**30:.3f} | "
                     + (f"{_need(r, 0) / max(r['peak_rss']):.2f} |" if r["peak_rss"] else "- |"))
    return "\n".join(lines)


def _train_tuned(out: str, name: str) -> bool:
    cmd = [sys.executable, "-m", "zerotrain.train", "--config-dir", out, f"+tuned={name}", "trainer.max_steps=3",
           "trainer.limit_val_batches=0", "sample_tokens=0", "trainer.enable_checkpointing=false",
           "callbacks.tensorboard=false", f"hydra.run.dir={out}/train"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    return subprocess.run(cmd, text=True).returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tune_sweep")
    ap.add_argument("--sweep-repeats", type=int, default=2)
    ap.add_argument("--sweep-steps", type=int, default=4)
    ap.add_argument("--tune-repeats", type=int, default=2)
    ap.add_argument("--tune-steps", type=int, default=4)
    ap.add_argument("--keep-within", type=float, default=0.05)
    ap.add_argument("--reuse-sweep", action="store_true",
                    help="take the sweep from --out/sweep/tune_results.json of an earlier run (one that ended "
                         "before its tune) instead of sweeping again; its time is then not in the total")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny GPT, 3 configurations, 1 step, 1 repeat: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sweep_repeats = args.tune_repeats = args.sweep_steps = args.tune_steps = 1
    from zerotrain.trainer.command.tune_search import STRATEGIES, search_space

    space = SMOKE_SPACE if args.smoke else []
    configs = 3 if args.smoke else len(search_space(STRATEGIES, 4, [4, 2], [1.0, 0.25]))
    print(f"tune_sweep: {configs} configurations; expected duration on a quiet 2-core machine: "
          f"~{expected_seconds(configs, args) / 60:.0f} min", flush=True)
    start = time.monotonic()
    out = os.path.abspath(args.out)
    done = f"{out}/sweep/tune_results.json"
    if args.reuse_sweep and os.path.exists(done):
        print(f"tune_sweep: the sweep of {time.ctime(os.path.getmtime(done))} from {done}", flush=True)
        with open(done) as f:
            sweep = json.load(f)
    else:
        sweep = _tune(args, f"{out}/sweep", *space, "--repeats", str(args.sweep_repeats), "--keep-within", "inf",
                      "--steps", str(args.sweep_steps), "--warmup-steps", "1")
    tune = _tune(args, f"{out}/tune", *space, "--repeats", str(args.tune_repeats), "--keep-within", str(args.keep_within),
                 "--steps", str(args.tune_steps), "--warmup-steps", "1")
    cap = cap_excluding_ddp(sweep["results"], sweep["margin"])
    # the sweep's base RSS, so the capped run's estimates are the ones the cap was set between
    micro = min(r["candidate"]["micro_batch"] for r in sweep["results"])  # where ddp's lowest estimate is
    capped = _tune(args, f"{out}/capped", "--max-rss-gb", repr(cap / 2**30), "--base-rss-gb",
                   repr(sweep["base_bytes"] / 2**30), "--strategies", ",".join(CAPPED), "--micro-batches", str(micro),
                   "--bucket-scales", "1", "--repeats", "1", "--steps", "1", "--warmup-steps", "1", "--name", "capped",
                   allow_none=True)
    trained = capped["winner"] is not None and _train_tuned(f"{out}/capped", "capped")
    elapsed = time.monotonic() - start + (sweep["elapsed_s"] if args.reuse_sweep and os.path.exists(done) else 0)
    print("\n" + section(sweep, tune, capped, cap, trained, elapsed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
