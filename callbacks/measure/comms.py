"""CommsLogger: every collective the strategies issue (op, message bytes, group size, latency,
algorithm and bus bandwidth), summarised by op and size at the end of ``fit``, with the bytes per
training step beside what the strategy's formula predicts.

Two ways to turn it on, the same logger either way: the strategy option ``comms_logger=True``
(``ZeroStage2(comms_logger=True)``, ``DDP(comms_logger=True)``, on the command line
``strategy.comms_logger=true``: the Trainer then adds a ``CommsLogger()`` unless one is given), or
the callback itself, ``Trainer(callbacks=[CommsLogger()])``, for any strategy.

Sizes follow nccl-tests and DeepSpeed's comms logger: the message is the whole buffer (an
all-gather's output, a reduce-scatter's input); algorithm bandwidth = bytes / time; bus bandwidth
= algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and reduce-scatter, x 1 otherwise.
The time of an async collective is from its launch to its completion (the backend's completion
callback), so a collective queued behind others in flight counts its wait in the queue: bandwidths
are lower bounds. On CUDA the completion is when the host learns of it.

What each strategy moves per optimizer step (Psi: trainable elements; ``expected_step_bytes``):

* ddp: all_reduce Psi x gradient bytes (the reducer's buckets; ``no_sync`` micro-batches none);
  on gloo beyond 2 ranks all_gather of world x Psi x gradient bytes (summed in rank order);
* zero1 / zero2: the gradient buckets, Psi x reduce bytes, as reduce to each owner (the default
  ``reduce_scatter``; ``all_reduce`` on gloo beyond 2 ranks or when asked), once per step in
  zero1, every micro-batch in zero2;
  then the parameter refresh: the padded layout (Psi rounded up to the world size) x working
  bytes, as one broadcast per rank on gloo, else all_gather;
* zero3, per micro-batch: all_gather of the root unit once and of every other sharded unit in
  forward and, when ``reshard_after_forward``, again in backward unless ``max_reuse_distance``
  kept it gathered (from the second step on; padded sizes, working bytes);
  every unit's gradient reduced once (reduce_scatter by default, reduce bytes);
  after the step one all_gather per persistent unit;
* every ZeRO stage, when clipping by norm (``strategies/zero/comm/grad_norm.py``, torch's rounding):
  an all_reduce of the fp32 per-parameter norms (4 bytes per parameter tensor) and one of each
  parameter a partition boundary cuts, whole in fp32 (``ZeroStrategy.grad_norm_bytes``).
* ZeRO++ (``quantize_weights`` / ``quantize_gradients``): a quantized gather or reduction moves
  1 byte per element plus a 4-byte scale per block, as two messages (codes, scales); quantized
  reductions are ``all_to_all`` (each owner's piece of a bucket from every rank). With
  ``hierarchical_partition`` (hpZ) the backward gathers read the node copy within the node: exact
  working bytes over the node's ranks, nothing at all with one rank per node.

In the ZeRO paper's units an all-reduce of S bytes moves 2S(n-1)/n per rank (reduce-scatter plus
all-gather), so zero1/2 all-reducing move 2Psi + Psi ("2Psi reduce + Psi gather") and ddp 2Psi;
a reduce to the owners moves Psi, as a reduce-scatter does, so zero1/2 by default move Psi + Psi.
The per-step table shows both the message bytes and these bus bytes. Each collective is filed
under its process group (``group_bytes``): "world", or a strategy mesh's axis ("data",
"sequence": Ulysses' all-to-alls, forward and backward; "tensor"; "replicas").
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from typing import Any

from ...strategies import instrument
from ..base import Callback

log = logging.getLogger("zerotrain")

#: the suffix of the loop's own collectives in the summary (``instrument.Collective.control``)
CONTROL = " (control)"

#: bus bandwidth / algorithm bandwidth, by op (n: group size)
_BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}


def bus_factor(op: str, n: int) -> float:
    return _BUS[op](n) if op in _BUS and n > 1 else 1.0


class CommsLogger(Callback):
    """Records every collective of ``fit`` (see the module docstring). ``verbose`` logs each one
    as it is issued. After ``fit``: ``summary`` (by op and size), ``step_bytes`` (op -> bytes
    of each training step) and ``expected`` (the formula's op -> bytes per step)."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.events: list[instrument.Collective] = []
        self.summary: list[dict[str, Any]] = []
        self.step_bytes: dict[int, dict[str, int]] = {}
        #: process group -> op -> message bytes over the training steps (``bytes_by_group``)
        self.group_bytes: dict[str, dict[str, int]] = {}
        self.expected: dict[str, int] = {}
        #: the first step's formula where it differs (zero3's reuse distance keeps nothing yet)
        self.expected_first: dict[str, int] = {}
        self._step: Any = "setup"
        self._kind = "setup"
        self._outer: list[str] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            instrument.add_sink(self)

    def collective(self, event: instrument.Collective) -> None:
        event.step, event.kind = self._step, self._kind
        self.events.append(event)
        if self.verbose:
            log.info("comm %s: %d bytes over %d ranks (step %s, %s)", event.op, event.nbytes, event.group_size,
                     event.step, event.kind)

    def on_train_start(self, trainer, pl_module) -> None:
        self._step, self._kind = trainer.global_step, "train"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step = trainer.global_step  # what follows belongs to the next step

    def on_validation_start(self, trainer, pl_module) -> None:
        self._outer.append(self._kind)
        self._kind = "eval"

    def on_validation_end(self, trainer, pl_module) -> None:
        self._kind = self._outer.pop() if self._outer else "train"

    def on_train_end(self, trainer, pl_module) -> None:
        self._kind = "end"

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        instrument.remove_sink(self)
        self.summary = summarise(self.events)
        self.step_bytes = bytes_per_step(self.events)
        self.group_bytes = bytes_by_group(self.events)
        self.expected = expected_step_bytes(trainer.strategy, trainer)
        self.expected_first = expected_step_bytes(trainer.strategy, trainer, first=True)
        if trainer.is_global_zero:
            print(format_report(self.summary, self.step_bytes, self.expected))
            if len(self.group_bytes) > 1:
                print(f"bytes by process group over the training steps: {self.group_bytes}")


class StepRecorder:
    """The CommsLogger's record for a loop that is not the Trainer's (``zerotrain.deepspeed``'s
    engine): a sink filing every collective under ``step``, which the owner moves on after each
    optimizer step."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose, self.step = verbose, 0
        self.events: list[instrument.Collective] = []

    def collective(self, event: instrument.Collective) -> None:
        event.step, event.kind = self.step, "train"
        self.events.append(event)
        if self.verbose:
            log.info("comm %s: %d bytes over %d ranks (step %s)", event.op, event.nbytes, event.group_size, event.step)

    def report(self, strategy: Any, accumulation: int, clip_bytes: int | None) -> tuple[list[dict[str, Any]], str]:
        """(summary rows, the printed report) of the steps so far, beside the formula. ``clip_bytes``:
        the all-reduce bytes the owner's clip by norm moves per step (None: it does not clip)."""
        loop = type("Loop", (), {"accumulate_grad_batches": accumulation, "gradient_clip_val": None})
        summary = summarise(self.events)
        done = [e for e in self.events if e.step < self.step]  # whole steps only
        expected = expected_step_bytes(strategy, loop)
        if expected and clip_bytes:
            expected["all_reduce"] = expected.get("all_reduce", 0) + clip_bytes
        return summary, format_report(summary, bytes_per_step(done), expected)


def comms_logger_for(strategy: Any, callbacks: list) -> list:
    """``callbacks`` plus a ``CommsLogger()`` when the strategy's options ask for one
    (``comms_logger=True``) and none is there already."""
    wanted = getattr(getattr(strategy, "config", None), "comms_logger", False)
    if wanted and not any(isinstance(c, CommsLogger) for c in callbacks):
        callbacks.append(CommsLogger())
    return callbacks


# ---------------------------------------------------------------------- summaries
def summarise(events: list[instrument.Collective]) -> list[dict[str, Any]]:
    """One row per (op, message bytes, group size, process group): count, latency and bandwidths
    (mean over the events whose completion was observed)."""
    rows: dict[tuple[str, int, int, str], list[instrument.Collective]] = defaultdict(list)
    for e in events:
        rows[(e.op + (CONTROL if e.control else ""), e.nbytes, e.group_size, e.group)].append(e)
    out = []
    for (op, size, n, group), evs in sorted(rows.items()):
        timed = [e.seconds for e in evs if e.seconds]
        mean = sum(timed) / len(timed) if timed else None
        algbw = size / mean if mean else None
        out.append({"op": op, "bytes": size, "group_size": n, "group": group, "count": len(evs),
                    "total_bytes": size * len(evs), "mean_latency_s": mean, "algbw": algbw,
                    "busbw": algbw * bus_factor(op.removesuffix(CONTROL), n) if algbw else None})
    return out


def bytes_by_group(events: list[instrument.Collective]) -> dict[str, dict[str, int]]:
    """Process group ("world", a mesh axis: "data", "sequence", "tensor", "replicas") -> op ->
    message bytes of the training steps (not set-up, validation or the loop's control)."""
    out: dict[str, Counter] = defaultdict(Counter)
    for e in events:
        if e.kind == "train" and not e.control:
            out[e.group][e.op] += e.nbytes
    return {g: dict(c) for g, c in out.items()}


def bytes_per_step(events: list[instrument.Collective]) -> dict[int, dict[str, int]]:
    """Training step -> op -> message bytes (training events only: not set-up, not validation,
    not the loop's control collectives, which no ZeRO formula counts)."""
    out: dict[int, Counter] = defaultdict(Counter)
    for e in events:
        if e.kind == "train" and not e.control:
            out[e.step][e.op] += e.nbytes
    return {s: dict(c) for s, c in out.items()}


def bus_bytes(by_op: dict[str, int], n: int) -> float:
    """What the ops move per rank on the bus (the ZeRO paper's volume)."""
    return sum(b * bus_factor(op, n) for op, b in by_op.items())


def format_report(summary: list[dict[str, Any]], step_bytes: dict[int, dict[str, int]],
                  expected: dict[str, int]) -> str:
    lines = ["CommsLogger: collectives by op and message size",
             f"{'op':<15}{'bytes':>14}{'ranks':>6}{'count':>8}{'avg ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in summary:
        ms = f"{r['mean_latency_s'] * 1e3:.3f}" if r["mean_latency_s"] else "-"
        alg = f"{r['algbw'] / 1e9:.3f}" if r["algbw"] else "-"
        bus = f"{r['busbw'] / 1e9:.3f}" if r["busbw"] else "-"
        lines.append(f"{r['op']:<15}{r['bytes']:>14}{r['group_size']:>6}{r['count']:>8}{ms:>10}{alg:>12}{bus:>12}")
    n = max((r["group_size"] for r in summary), default=1)
    distinct = Counter(tuple(sorted(v.items())) for v in step_bytes.values())
    lines.append("bytes per training step (message bytes by op; bus bytes per rank):")
    for ops, count in distinct.most_common():
        lines.append(f"  measured ({count} step(s)): {dict(ops)}; bus {bus_bytes(dict(ops), n):.0f}")
    lines.append(f"  formula: {expected}; bus {bus_bytes(expected, n):.0f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the formulas
def expected_step_bytes(strategy: Any, trainer: Any = None, first: bool = False) -> dict[str, int]:
    """Op -> message bytes one optimizer step moves under ``strategy`` (see the module docstring);
    ``trainer`` gives the accumulation and clipping ({} for a strategy without a formula: single,
    pipeline, or one process). zero3 keeps the units its reuse distance holds from their forward
    to their backward from the second step on (the first records the order): ``first`` gives
    that first step, with every unit gathered again in backward."""
    if not getattr(strategy, "distributed", False):
        return {}
    accumulation = getattr(trainer, "accumulate_grad_batches", 1)
    clips = bool(getattr(trainer, "gradient_clip_val", None)) and \
        getattr(trainer, "gradient_clip_algorithm", None) in (None, "norm")  # None: by norm, as Lightning
    stage = getattr(strategy, "stage", None)
    if getattr(strategy, "name", "") == "ddp" or type(strategy).__name__ in ("DDP", "DDPStrategy"):
        return _ddp_bytes(strategy)
    if stage in (1, 2):
        out = _zero12_bytes(strategy, accumulation if stage == 2 else 1)
    elif stage == 3:
        out = _zero3_bytes(strategy, accumulation, first)
    else:
        return {}
    if clips:
        out["all_reduce"] = out.get("all_reduce", 0) + strategy.grad_norm_bytes()
    return out


def _ddp_bytes(strategy: Any) -> dict[str, int]:
    grads = sum(p.numel() * p.element_size() for p in strategy.module.parameters() if p.requires_grad)
    if getattr(strategy, "sums_in_rank_order", False):
        return {"all_gather": grads * strategy.world_size}
    return {"all_reduce": grads}


def _add(out: dict[str, int], op: str, nbytes: int) -> None:
    if nbytes:
        out[op] = out.get(op, 0) + nbytes


def _zero12_bytes(strategy: Any, reductions: int) -> dict[str, int]:
    from ...strategies.zero.comm.quantized import wire_bytes

    out: dict[str, int] = {}
    reduce_bytes = strategy.config.torch_reduce_dtype.itemsize
    reduce_op = {"all_reduce": "all_reduce", "quantized": "all_to_all"}.get(strategy.reduce_mode, "reduce")
    gather_op = "broadcast" if instrument_backend(strategy) == "gloo" else "all_gather"
    for gi, fg in enumerate(strategy.flat_groups):
        if reduce_op == "all_to_all":  # qgZ: each bucket's owners' pieces as int8 + scales
            block = strategy.config.quantize_block_size
            sent = sum(wire_bytes([r.numel for r in b.runs], block) for b in strategy.grads.buckets if b.group == gi)
        else:
            sent = fg.layout.numel * reduce_bytes
        _add(out, reduce_op, reductions * sent)
        _add(out, gather_op, fg.layout.padded_numel * fg.flat.element_size())
    return out


def _zero3_bytes(strategy: Any, micro_batches: int, first: bool = False) -> dict[str, int]:
    from ...strategies.zero.comm.quantized import wire_bytes

    out: dict[str, int] = {}
    reduce_bytes = strategy.config.torch_reduce_dtype.itemsize
    reduce_op = {"all_reduce": "all_reduce", "quantized": "all_to_all"}.get(strategy.reduce_mode, "reduce_scatter")
    twice = 2 if strategy.stage3.reshard_after_forward else 1
    block = strategy.config.quantize_block_size
    kept = set() if first else strategy.runtime.kept  # the reuse distance's units: one gather
    for u in strategy.units:
        world = u.layout.world_size
        int8 = wire_bytes([u.numel // world] * world, block)  # qwZ / qgZ: codes + scales
        working = u.numel * u.full.element_size()
        if u.persistent:
            _add(out, "all_gather", working)  # the refresh after the step (never quantized)
        else:
            gathered = int8 if strategy.stage3.quantize_weights else working
            again = gathered  # the backward gather; hpZ: exact, from the node copy, within the node
            if strategy.stage3.hierarchical_partition:
                again = working if strategy.info.local_world_size > 1 else 0
            repeat = 0 if u is strategy.units[0] or u.index in kept else twice - 1
            _add(out, "all_gather", micro_batches * (gathered + repeat * again))
        _add(out, reduce_op, micro_batches * (int8 if reduce_op == "all_to_all" else u.numel * reduce_bytes))
    return out


def instrument_backend(strategy: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(getattr(strategy, "group", None))) if dist.is_initialized() else "none"
