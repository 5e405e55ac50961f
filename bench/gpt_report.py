"""``gpt_bench``'s driver side: one run's summary from its ranks' records, and the markdown it
prints (the medians over repeats, each repeat's ratio to the baseline, the pipeline's bubble and
every step's loss).

Why the table of repeats: on this shared 2-core VM the baseline's own step moved by 20-30% within
an hour, more than the differences being measured. Repeats are interleaved (every system once,
then every system again), so dividing a system's step by the baseline's *in the same repeat*
cancels most of that drift; the median of those ratios is the figure to read.

The CPU column is the process CPU time (user + system, all threads: the compute, gloo's threads,
the kernel's page faults) per step, summed over ranks, the median over timed steps. It is what a
system costs the cores whatever else the machine runs; with every rank's threads sharing 2 cores,
a system that needs less of it is the faster one on a quiet machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from zerotrain.bench.common import MODELS
from zerotrain.bench.gpt_systems import FLOOR_SYSTEMS, base_system

#: stages of every pipeline system (each replica's ranks are consecutive)
PIPE_STAGES = 2


@dataclass
class RunSummary:
    """One run of one system: the slowest rank's median step, the largest rank's RSS and the
    loss curve averaged over ranks."""

    step_s: float
    rss_peak: int
    rss_delta: int
    losses: list[float]
    #: the median over timed steps of the largest rank's minor page faults per step
    faults: float
    optimizer: str
    threads: int
    #: the median over timed steps of the CPU seconds all ranks used in the step (NaN: not recorded)
    cpu_s: float = float("nan")
    exit_note: str = ""
    #: pipeline only: per stage, the medians of ``stage_breakdown``
    stages: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: the slowest rank's first step (warm-up included: compiling, first-touch allocation)
    first_step_s: float = float("nan")


def _median_per_step(records: list[dict], key: str, warmup: int, combine) -> float:
    """The median over timed steps of ``combine`` (max, sum) over ranks of ``record[key]``."""
    if not all(r.get(key) for r in records):
        return float("nan")
    return statistics.median(combine(v) for v in zip(*(r[key][warmup:] for r in records)))


def summarise_run(records: list[dict], warmup: int) -> RunSummary:
    medians = [statistics.median(r["step_times"][warmup:]) for r in records]
    n = min(len(r["losses"]) for r in records)
    losses = [statistics.fmean(r["losses"][i] for r in records) for i in range(n)]
    return RunSummary(step_s=max(medians), rss_peak=max(r["rss_peak"] for r in records),
                      rss_delta=max(r["rss_peak"] - r["rss_base"] for r in records), losses=losses,
                      faults=_median_per_step(records, "step_faults", warmup, max),
                      cpu_s=_median_per_step(records, "step_cpu", warmup, sum),
                      optimizer=records[0]["optimizer"], threads=max(r["threads"] for r in records),
                      stages=stage_breakdown(records, warmup),
                      first_step_s=max(r["step_times"][0] for r in records))


def stage_breakdown(records: list[dict], warmup: int) -> list[dict[str, float]]:
    """Pipeline runs: per stage (the mean over its replicas' ranks) the median over the timed steps
    of its forward/backward compute, its time in exchanges (waiting on or moving activations and
    gradients), the schedule's wall time, the rest of the step (gradient reduction, optimizer,
    Trainer) and the bubble: the share of the schedule outside compute. Empty for other systems."""
    per_rank = []
    for r in records:
        sched, times = r.get("schedule", [])[warmup:], r["step_times"][warmup:]
        if not sched:
            return []
        per_rank.append({"compute_s": statistics.median(s["compute_s"] for s in sched),
                         "comm_s": statistics.median(s["comm_s"] for s in sched),
                         "wall_s": statistics.median(s["wall_s"] for s in sched),
                         "outside_s": statistics.median(t - s["wall_s"] for s, t in zip(sched, times)),
                         "bubble": statistics.median(1.0 - s["compute_s"] / s["wall_s"] for s in sched)})
    stages = [[row for rank, row in enumerate(per_rank) if rank % PIPE_STAGES == stage]
              for stage in range(PIPE_STAGES)]
    return [{k: statistics.fmean(row[k] for row in rows) for k in rows[0]} for rows in stages if rows]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("nan")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render(args: argparse.Namespace, results: dict[str, list[RunSummary]], skipped: dict[str, str],
           failed: dict[str, str], pipe_systems: Mapping[str, Sequence] | None = None) -> str:
    """The markdown table (median over repeats per system), the notes under it, then the table of
    repeats, the pipeline's and the losses'. ``pipe_systems``: name -> (m, v, balanced, schedule)."""
    notes = [f"{s}: skipped: {why}" for s, why in skipped.items()]
    notes += [f"{s}: FAILED: {why}" for s, why in failed.items()]
    if not results:
        return "No system completed.\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    spec = MODELS[args.model]
    tokens = spec.micro_batch * spec.block_size * args.nproc  # per optimizer step, all ranks
    step = {s: statistics.median(r.step_s for r in runs) for s, runs in results.items() if runs}
    base_name = "ddp" if "ddp" in step else next(iter(step), None)
    base = results[base_name][0].losses if base_name else []
    lines = [f"| system | median step (s) | x {base_name} | spread | tokens/s | CPU s/step (all ranks) "
             f"| peak RSS/rank (GB) | dRSS (GB) | faults/step (k) | loss first | loss last "
             f"| max abs dloss vs {base_name} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, runs in results.items():
        if not runs:
            continue
        t = step[s]
        ts = [r.step_s for r in runs]
        spread = f"{(max(ts) - min(ts)) / t * 100:.0f}%" if len(ts) > 1 else "-"
        first = runs[0]
        rss = statistics.median(r.rss_peak for r in runs)
        drss = statistics.median(r.rss_delta for r in runs)
        faults = statistics.median(r.faults for r in runs) / 1e3
        cpu = statistics.median(r.cpu_s for r in runs)
        lines.append(f"| {s} | {t:.4f} | {t / step[base_name]:.2f} | {spread} | {tokens / t:,.0f} | {cpu:.2f} "
                     f"| {_gb(rss)} | {_gb(drss)} | {faults:.0f} | {first.losses[0]:.6f} | {first.losses[-1]:.6f} "
                     f"| {max_abs_diff(first.losses, base):.2e} |")
        drift = max(max_abs_diff(r.losses, first.losses) for r in runs)
        if drift > 0:
            notes.append(f"{s}: loss curves differ between repeats by up to {drift:.2e} (non-deterministic)")
        notes += [f"{s}: {r.exit_note}" for r in runs if r.exit_note]
        if first.threads != args.threads:
            notes.append(f"{s}: ran with {first.threads} threads per rank, not {args.threads}")
    opts = sorted({f"{s}: {runs[0].optimizer}" for s, runs in results.items() if runs})
    notes.append("optimizer per system: " + "; ".join(opts))
    return ("\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
            + render_rounds(results, base_name) + render_rounds(results, floor_system(results, base_name))
            + render_pipeline(results, pipe_systems or {})
            + render_losses(results, base_name))


def round_ratios(results: dict[str, list[RunSummary]], base_name: str) -> dict[str, list[float]]:
    """Per system, its step divided by the baseline's in the same repeat, for every repeat both
    completed (repeat i of each is its i-th run: a failed run ends a system's runs)."""
    base = [r.step_s for r in results.get(base_name, [])]
    return {s: [r.step_s / b for r, b in zip(runs, base)] for s, runs in results.items() if runs}


def floor_system(results: dict[str, list[RunSummary]], base_name: str | None) -> str | None:
    """The first ``solo`` system that ran (with any suffix), unless it is the baseline: the
    step's compute floor, whose own table of ratios follows the baseline's."""
    return next((s for s, runs in results.items() if runs and s != base_name
                 and base_system(s) in FLOOR_SYSTEMS), None)


def render_rounds(results: dict[str, list[RunSummary]], base_name: str | None) -> str:
    """Each repeat's step ratio to the baseline and their median (with 2+ repeats)."""
    if base_name is None or len(results.get(base_name, [])) < 2:
        return ""
    ratios = round_ratios(results, base_name)
    reps = len(results[base_name])
    lines = [f"\n| system | " + " | ".join(f"r{i}" for i in range(reps)) + " | median of the ratios |",
             "|---|" + "---|" * (reps + 1),
             f"| {base_name}'s step (s) | " + " | ".join(f"{r.step_s:.3f}" for r in results[base_name]) + " | |"]
    for s, rs in ratios.items():
        if s == base_name:
            continue
        cells = [f"{x:.2f}" for x in rs] + ["-"] * (reps - len(rs))
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {statistics.median(rs):.2f} |")
    return ("\n".join(lines) + f"\n\n- each repeat: the system's step divided by {base_name}'s in the same "
            "repeat (interleaved, so the machine's drift cancels)\n")


def render_pipeline(results: dict[str, list[RunSummary]], pipe_systems: Mapping[str, Sequence]) -> str:
    """The pipeline systems' bubble (median over repeats) beside (p-1)/(m+p-1), and where each
    stage's step went (the first repeat's medians, seconds)."""
    rows = [(s, runs) for s, runs in results.items() if runs and runs[0].stages]
    if not rows:
        return ""
    from zerotrain.strategies.pipeline.schedule import bubble_fraction

    p = PIPE_STAGES
    head = " | ".join(f"stage {i}: compute / exchanges / rest of step (s)" for i in range(p))
    lines = [f"\n| system | m | v | bubble measured | bubble theory (p-1)/(vm+p-1), zb: (p-1)/(3vm+p-1) | {head} |",
             "|---|---|---|---|---|" + "---|" * p]
    for s, runs in rows:
        m, v, _, schedule = pipe_systems[s]
        bubble = statistics.median(statistics.fmean(st["bubble"] for st in r.stages) for r in runs)
        split = " | ".join(f"{st['compute_s']:.3f} / {st['comm_s']:.3f} / {st['outside_s']:.3f}"
                           for st in runs[0].stages)
        # ZB-H1 (F = B = W) idles as 1F1B would with 3 m micro-batches
        theory = bubble_fraction(p, (3 if schedule == "zb_h1" else 1) * m, v)
        lines.append(f"| {s} | {m} | {v} | {bubble:.3f} | {theory:.3f} | {split} |")
    return ("\n".join(lines) + "\n\n- bubble measured: the share of a stage's schedule (its forwards, backwards "
            "and activation exchanges) spent outside forward/backward compute, the mean over the stages; "
            "'rest of step': the step outside the schedule (gradient reduction, optimizer step, Trainer)\n")


def render_losses(results: dict[str, list[RunSummary]], base_name: str | None) -> str:
    """Every system's loss at every step (warm-up included; the first repeat), beside the baseline's.
    The last column's maximum leaves out the floor (``solo``), whose losses leave the baseline's by
    design."""
    runs = {s: r[0].losses for s, r in results.items() if r}
    if not runs:
        return ""
    names = list(runs)
    compared = [base_system(s) not in FLOOR_SYSTEMS for s in names]
    lines = ["\n| step | " + " | ".join(names) + f" | max abs dloss vs {base_name} |",
             "|---|" + "---|" * (len(names) + 1)]
    for i in range(max(len(v) for v in runs.values())):
        got = [v[i] if i < len(v) else float("nan") for v in runs.values()]
        base = runs[base_name][i] if base_name and i < len(runs[base_name]) else float("nan")
        worst = max((abs(x - base) for x, c in zip(got, compared) if c), default=0.0)
        lines.append(f"| {i} | " + " | ".join(f"{x:.6f}" for x in got) + f" | {worst:.2e} |")
    return "\n".join(lines) + "\n"
