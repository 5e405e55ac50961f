"""The search behind ``zerotrain-tune``: which strategy, micro-batch, bucket size and activation
checkpointing train a given model fastest within a rank's memory.

Everything here but :func:`run_config` (one short training run in a subprocess) is pure, so the
space, the pruning, the ranking, the table and the tuned config file are tested without processes.
The model-specific numbers (parameters, activation bytes) come from the application in a
:class:`MemoryModel`: the library knows no model (``tune.py`` at the root fills it in from the
module the config's ``_target_`` names).

* **Space** (:func:`search_space`): strategies x micro-batch sizes (gradient accumulation adjusted
  so each rank still sees the same samples per optimizer step: the global batch is kept) x two
  bucket sizes (``bucket_cap_mb`` for ddp, ``reduce_bucket_size`` and ``allgather_bucket_size``
  together for zero1/zero2/offload, ``prefetch_bucket_size`` for zero3) x activation checkpointing
  (ZeRO-3 only: it is the strategy's option, ``Stage3Config.activation_checkpointing``).
* **Pruning** (:func:`prune`): base RSS + model states (the ZeRO formulas of
  ``strategies/zero/estimate.py``) + the larger of the backward's peak (activations + gradients and
  gathered parameters in flight) and the optimizer step's temporaries, times ``1 + margin``,
  against the cap per rank. The estimate is meant to sit just under the measured peak (the
  margin is the headroom): it prunes only what its run would not fit with that headroom.
* **Measuring** (:func:`measure`): every surviving configuration runs, then again in the next
  round, round-robin (never back to back, so a slow spell of the machine hits all alike); after
  the first round only those within ``keep_within`` of the fastest go on.
* **Ranking** (:func:`rank`): by the median over repeats of the mean step time after warm-up; a
  configuration whose measured peak RSS broke the cap, or whose run failed, cannot win.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from ...strategies import registry
from ...strategies.zero.estimate import estimate_model_states, format_bytes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "offload")
#: the strategy options one "bucket size" choice sets (offload: its default stage 2)
BUCKET_FIELDS = {
    "ddp": ("bucket_cap_mb",),
    "zero1": ("reduce_bucket_size", "allgather_bucket_size"),
    "zero2": ("reduce_bucket_size", "allgather_bucket_size"),
    "zero3": ("prefetch_bucket_size",),
    "offload": ("reduce_bucket_size", "allgather_bucket_size"),
}
#: the strategies whose option ``activation_checkpointing`` recomputes each unit's forward
CHECKPOINTING = ("zero3",)
#: the estimator's stage for each strategy (model states per rank)
_STAGE = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "offload": "zero2"}
GiB = 2**30


class TuneError(ValueError):
    """Bad input to the tuner, worded ``field=value: problem; valid: ...``."""


def _bad(name: str, value: Any, problem: str, valid: str) -> TuneError:
    return TuneError(f"{name}={value!r}: {problem}; valid: {valid}")


# ---------------------------------------------------------------------- the space
@dataclass(frozen=True)
class Candidate:
    """One configuration: a strategy, the micro-batch per rank and the accumulation that keeps the
    samples per optimizer step, the bucket size (in the unit of the strategy's bucket option), and
    activation checkpointing."""

    strategy: str
    micro_batch: int
    accumulate: int
    bucket: float
    checkpointing: bool = False

    def strategy_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {f: self.bucket for f in BUCKET_FIELDS[self.strategy]}
        if self.checkpointing:
            opts["activation_checkpointing"] = True
        if self.strategy == "zero3":  # the memory model below is fitted to units freed after forward
            opts["max_reuse_distance"] = 0
        return opts

    def overrides(self) -> list[str]:
        """The ``zerotrain-train`` command-line overrides that select this configuration."""
        return ([f"strategy={self.strategy}"] + [f"strategy.{k}={_value(v)}" for k, v in self.strategy_options().items()]
                + [f"data.batch_size={self.micro_batch}", f"trainer.accumulate_grad_batches={self.accumulate}"])

    @property
    def label(self) -> str:
        bucket = f"{self.bucket:g}MB" if self.strategy == "ddp" else f"{self.bucket:.3g}"
        return (f"{self.strategy} mb{self.micro_batch}x{self.accumulate} b{bucket}"
                + (" ckpt" if self.checkpointing else ""))


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def bucket_choices(strategy: str, scales: Sequence[float]) -> list[float]:
    """The strategy's default bucket size times each scale (element counts stay whole numbers)."""
    default = registry.get(strategy).fields()[BUCKET_FIELDS[strategy][0]][1]
    values = [max(1, int(round(default * s))) if isinstance(default, int) else float(default * s) for s in scales]
    return list(dict.fromkeys(values))


def micro_batch_choices(per_rank: int, wanted: Optional[Sequence[int]] = None) -> list[int]:
    """``wanted`` checked against ``per_rank`` (samples a rank takes per optimizer step), or by
    default ``per_rank`` and its half when it is even: two points, the space stays small."""
    if wanted is None:
        return [per_rank] + ([per_rank // 2] if per_rank % 2 == 0 and per_rank > 1 else [])
    for m in wanted:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or per_rank % m:
            divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            raise _bad("--micro-batches", m, f"must divide the {per_rank} samples each rank takes per optimizer "
                       "step (data.batch_size x trainer.accumulate_grad_batches), so the global batch is kept",
                       ", ".join(map(str, divisors)))
    return list(dict.fromkeys(wanted))


def check_strategies(names: Iterable[str]) -> list[str]:
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise _bad("--strategies", "", "is empty", ", ".join(STRATEGIES))
    for n in names:
        if n not in STRATEGIES:
            raise _bad("--strategies", n, "is not a strategy the tuner searches", ", ".join(STRATEGIES))
    return list(dict.fromkeys(names))


def search_space(strategies: Sequence[str], per_rank: int, micro_batches: Sequence[int],
                 bucket_scales: Sequence[float], checkpointing: bool = True) -> list[Candidate]:
    """Every combination; each keeps ``micro_batch x accumulate == per_rank``."""
    out = []
    for s in check_strategies(strategies):
        ckpt = (False, True) if checkpointing and s in CHECKPOINTING else (False,)
        for m in micro_batch_choices(per_rank, micro_batches):
            for b in bucket_choices(s, bucket_scales):
                out += [Candidate(s, m, per_rank // m, b, c) for c in ckpt]
    return out


# ---------------------------------------------------------------------- memory and pruning
@dataclass(frozen=True)
class MemoryModel:
    """What the estimate needs to know about the run. ``base_bytes``: a rank before its model
    (interpreter, torch, process group, data); ``activation_bytes(micro_batch, checkpointing)``:
    the application's estimate for its model."""

    num_params: int
    world_size: int
    precision: str
    base_bytes: int
    activation_bytes: Callable[[int, bool], int]


def _precision_bytes(precision: str) -> dict[str, Any]:
    """The estimator's arguments for a precision (bf16-true: 2-byte params, grads and Adam state)."""
    if precision == "bf16-true":
        return {"precision": "32", "param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 4}
    return {"precision": precision}


#: Bytes per parameter, beyond the model states, that a rank holds at the peak of its backward
#: while the activations are alive: gradients produced before they reach their (partitioned) home
#: and, under ZeRO-3, the gathered parameters of the running and the prefetched unit with their
#: gradients. Fitted (with :data:`STEP_BYTES_PER_PARAM`) to the peak RSS of the 24-configuration
#: sweep of the 21M GPT on 2 CPU ranks (bench/RESULTS.md, 2026-12-01 06:51): with them the estimate
#: lay within 0.88-1.00x of every measured peak. Bucket sizes moved peak RSS by no more than the
#: repeats' noise there (a freed gradient's memory is reused for the bucket), so they are not a term.
IN_FLIGHT_BYTES_PER_PARAM = {"ddp": 2, "zero1": 1, "zero2": 5, "offload": 5, "zero3": 12}
#: Bytes per parameter this rank steps (all of them under ddp, its partition under ZeRO) that the
#: optimizer step's temporaries take (torch's multi-tensor AdamW): the other candidate for the peak
#: when the activations are small.
STEP_BYTES_PER_PARAM = 13


def in_flight_bytes(c: Candidate, num_params: int) -> int:
    return IN_FLIGHT_BYTES_PER_PARAM[c.strategy] * num_params


def step_bytes(c: Candidate, num_params: int, world_size: int) -> int:
    stepped = num_params if c.strategy == "ddp" else math.ceil(num_params / world_size)
    return STEP_BYTES_PER_PARAM * stepped


def estimate(c: Candidate, m: MemoryModel) -> dict[str, int]:
    """Peak RSS of one rank, by part, and their ``total`` (before the margin): the base and the
    model states always, and on top the larger of the backward's peak (activations + what is in
    flight) and the optimizer step's temporaries."""
    states = estimate_model_states(m.num_params, m.world_size, **_precision_bytes(m.precision))[_STAGE[c.strategy]]
    parts = {"base": m.base_bytes, "states": states.total,
             "activations": m.activation_bytes(c.micro_batch, c.checkpointing),
             "in_flight": in_flight_bytes(c, m.num_params), "step": step_bytes(c, m.num_params, m.world_size)}
    parts["total"] = (parts["base"] + parts["states"]
                      + max(parts["activations"] + parts["in_flight"], parts["step"]))
    return parts


def check_cap(cap_gb: Any) -> None:
    if isinstance(cap_gb, bool) or not isinstance(cap_gb, (int, float)) or not math.isfinite(cap_gb) or cap_gb <= 0:
        raise _bad("--max-rss-gb", cap_gb, "must be a finite number of GiB > 0", "e.g. 1.5")


def check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 10:
        raise _bad("--margin", margin, "must be a fraction in [0, 10)", "e.g. 0.1 for 10%")


def prune(cands: Sequence[Candidate], m: MemoryModel, cap_bytes: float, margin: float
          ) -> tuple[list[Candidate], dict[Candidate, str]]:
    """(kept, {pruned: why}): a configuration is pruned when its estimate times ``1 + margin``
    exceeds the cap."""
    kept, pruned = [], {}
    for c in cands:
        need = estimate(c, m)["total"] * (1 + margin)
        if need > cap_bytes:
            pruned[c] = f"estimate {need / GiB:.3f} GiB (incl. {margin:.0%} margin) > cap {cap_bytes / GiB:.3f} GiB"
        else:
            kept.append(c)
    return kept, pruned


# ---------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    """One short run: mean step time over the steps after warm-up (mean over ranks), and each
    rank's peak RSS (bytes), as the run's own ResourceMonitor recorded them."""

    step_s: float
    peak_rss: list[float]
    steps: int


class RunFailed(RuntimeError):
    pass


def read_run(path: str, warmup: int) -> Measurement:
    """The ResourceMonitor's JSON (``callbacks.resources_json``): ``{"ranks": [[record, ...], ...]}``."""
    with open(path) as f:
        ranks = json.load(f)["ranks"]
    if not ranks or any(len(r) <= warmup for r in ranks):
        raise RunFailed(f"{path}: {min(map(len, ranks), default=0)} step(s) recorded, need more than the "
                        f"{warmup} warm-up step(s)")
    means = [statistics.fmean(s["step"] for s in r[warmup:]) for r in ranks]
    return Measurement(statistics.fmean(means), [max(s["rss_peak"] for s in r) for r in ranks],
                       len(ranks[0]) - warmup)


def run_config(command: list[str], run_dir: str, warmup: int, timeout_s: float) -> Measurement:
    """Run ``command`` (a ``zerotrain-train`` command line ending with this run's overrides) in
    ``run_dir``; its output goes to ``run_dir/log.txt``; the timing comes from ``resources.json``
    there, which the command must name as ``callbacks.resources_json``."""
    os.makedirs(run_dir, exist_ok=True)
    log = os.path.join(run_dir, "log.txt")
    try:
        with open(log, "w") as out:
            rc = subprocess.run(command, cwd=run_dir, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                stdin=subprocess.DEVNULL).returncode
    except subprocess.TimeoutExpired:
        raise RunFailed(f"timed out after {timeout_s:.0f} s (log: {log})") from None
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = [ln for ln in f.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise RunFailed(f"exit code {rc}: {tail[0][:200]} (log: {log})")
    return read_run(os.path.join(run_dir, "resources.json"), warmup)


@dataclass
class Result:
    candidate: Candidate
    estimate: dict[str, int]
    status: str = "pending"  # ok | pruned | failed | over cap | dropped
    why: str = ""
    runs: list[Measurement] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return statistics.median(r.step_s for r in self.runs) if self.runs else math.inf

    @property
    def peak_rss(self) -> list[float]:
        """Per rank, the highest over the repeats."""
        return [max(col) for col in zip(*(r.peak_rss for r in self.runs))] if self.runs else []


def measure(results: Sequence[Result], run: Callable[[Candidate, int], Measurement], repeats: int,
            keep_within: float, progress: Any = None) -> None:
    """Rounds of runs, round-robin over the configurations still in the race: each round runs
    every one once. After the first round, a configuration slower than the fastest by more than
    ``keep_within`` (a fraction) is dropped; a failed run drops it. ``progress``: a tqdm bar."""
    alive = [r for r in results if r.status == "pending"]
    for rnd in range(repeats):
        for r in alive:
            if progress is not None:
                progress.set_postfix_str(f"round {rnd + 1}/{repeats}: {r.candidate.label}")
            try:
                r.runs.append(run(r.candidate, rnd))
            except RunFailed as exc:
                r.status, r.why = "failed", str(exc)
            if progress is not None:
                progress.update(1)
        alive = [r for r in alive if r.status == "pending"]
        if rnd == 0 and alive and rnd + 1 < repeats:
            best = min(r.step_s for r in alive)
            for r in alive:
                if r.step_s > best * (1 + keep_within):
                    r.status, r.why = "dropped", f"{r.step_s / best - 1:.0%} slower than the fastest after round 1"
            alive = [r for r in alive if r.status == "pending"]
            if progress is not None:  # the dropped ones' later rounds will not run
                progress.total = progress.n + len(alive) * (repeats - 1)
                progress.refresh()
    for r in alive:
        r.status = "ok"


def apply_cap(results: Sequence[Result], cap_bytes: Optional[float]) -> None:
    """A measured run whose peak RSS on any rank broke the cap cannot win."""
    for r in results:
        if cap_bytes is not None and r.status in ("ok", "dropped") and r.runs and max(r.peak_rss) > cap_bytes:
            r.status, r.why = "over cap", f"measured {max(r.peak_rss) / GiB:.3f} GiB > cap {cap_bytes / GiB:.3f} GiB"


_ORDER = {"ok": 0, "dropped": 1, "over cap": 2, "failed": 3, "pruned": 4, "pending": 5}


def rank(results: Iterable[Result]) -> list[Result]:
    """Measured and eligible first, fastest first; then those the race dropped, those over the
    cap, the failed and the pruned."""
    return sorted(results, key=lambda r: (_ORDER[r.status], r.step_s, r.estimate["total"]))


def winner(ranked: Sequence[Result]) -> Optional[Result]:
    return ranked[0] if ranked and ranked[0].status == "ok" else None


# ---------------------------------------------------------------------- reporting
def format_table(ranked: Sequence[Result], tokens_per_step: int, default: Optional[Candidate] = None) -> str:
    """The ranked table: step time, tokens/s, peak RSS per rank (and the estimate beside it)."""
    lines = [f"{'#':>3}  {'configuration':<34}{'step ms':>9}{'tokens/s':>10}  {'peak RSS per rank GiB':<22}"
             f"{'est GiB':>8}  status"]
    for i, r in enumerate(ranked, 1):
        c = r.candidate
        timed = bool(r.runs)
        step = f"{r.step_s * 1e3:9.1f}" if timed else f"{'-':>9}"
        tps = f"{tokens_per_step / r.step_s:10.0f}" if timed else f"{'-':>10}"
        rss = "/".join(f"{b / GiB:.3f}" for b in r.peak_rss) if timed else "-"
        mark = " (default)" if c == default else ""
        status = r.status + (f" x{len(r.runs)}" if r.status == "ok" else "") + (f": {r.why}" if r.why else "")
        lines.append(f"{i:>3}  {c.label + mark:<34}{step}{tps}  {rss:<22}{r.estimate['total'] / GiB:8.3f}  {status}")
    return "\n".join(lines)


def tuned_yaml(choices: dict[str, str], values: dict[str, Any], header: str) -> str:
    """A config of the ``tuned`` group (``+tuned=NAME``): it selects every config group's option as
    the winner's composition did (``override /strategy: zero2``, ...) and sets every value, so the
    composed config equals the winner's whatever the command line's defaults were."""
    from omegaconf import OmegaConf

    body = OmegaConf.to_yaml(OmegaConf.create(
        {"defaults": [{f"override /{g}": o} for g, o in choices.items()] + ["_self_"], **values}))
    comment = "".join(f"# {ln}\n" if ln else "#\n" for ln in header.splitlines())
    return f"# @package _global_\n{comment}{body}"


def write_results(path: str, ranked: Sequence[Result], extra: dict[str, Any]) -> None:
    """Everything measured, as JSON (``bench/tune_sweep.py`` reads it)."""
    rows = [{"label": r.candidate.label, "candidate": vars(r.candidate), "status": r.status, "why": r.why,
             "estimate": r.estimate, "step_s": [m.step_s for m in r.runs], "peak_rss": r.peak_rss,
             "median_step_s": r.step_s if r.runs else None} for r in ranked]
    with open(path, "w") as f:
        json.dump({**extra, "results": rows}, f, indent=1)


def describe_estimate(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items())
