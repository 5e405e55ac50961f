"""A schedule simulator: every stage's instruction list run together, in simulated time.

It is the proof that a schedule is safe to execute and the measure of what it costs:

* **Deadlock freedom** under the strictest semantics the executor may meet (NCCL's): an exchange
  (consecutive communication instructions, ``schedule.steps``) completes only when each of its
  operations has met the matching operation in the peer's *current* exchange. Traffic on one link
  in one direction is first-in first-out, so a receive must match the sender's chunk and
  micro-batch. If no stage can move, :class:`Deadlock` names where each one waits.
* **Data flow**: a forward only after its input arrived (or was loaded), a backward only after its
  forward and its output gradient, every micro-batch through every chunk once.
* **Time**: forwards cost ``forward_cost / virtual_stages`` and backwards ``backward_cost /
  virtual_stages`` (a chunk holds ``1 / virtual_stages`` of the stage's layers); communication is
  free. In split-backward schedules (``WeightGrad`` instructions) ``weight_cost`` of the
  backward moves to the ``WeightGrad``; one that is part of an exchange runs after its
  operations are posted, so the exchange ends when both its matches and those weight gradients
  are done. The step's makespan against the ideal ``m * (forward_cost + backward_cost)`` gives the
  bubble, and each stage's peak number of live chunk activations is counted as it runs.

With virtual stages the stages form a ring: chunk ``c`` of stage ``s`` sends its activations to
stage ``s + 1`` (chunk ``c``), and the last stage sends to stage 0 (chunk ``c + 1``); gradients
travel the other way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .schedule import (COMM, Backward, Forward, Instruction, LoadMicroBatch, RecvActivation, RecvGrad,
                       SendActivation, SendGrad, WeightGrad, steps)


class Deadlock(AssertionError):
    """No stage can move."""


class ScheduleError(AssertionError):
    """A schedule breaks the data flow (or a receive meets the wrong message)."""


#: a send's type -> (direction to its peer, the receive that matches it)
_SENDS = {SendActivation: (+1, RecvActivation), SendGrad: (-1, RecvGrad)}


@dataclass(frozen=True)
class SimResult:
    #: per stage: most chunk activations (forwards awaiting their backward) held at once
    peak_live: list[int]
    #: simulated time of the whole step
    makespan: float
    #: per stage: time spent computing
    busy: list[float]
    #: the step's time if no stage ever waited: micro_batches x (forward + backward)
    ideal: float

    @property
    def bubble(self) -> float:
        """Idle time of the step over the ideal time (``(p - 1) / (v * m)`` for interleaved 1F1B)."""
        return (self.makespan - self.ideal) / self.ideal

    @property
    def idle_fraction(self) -> float:
        """Idle share of the step (``(p - 1) / (v * m + p - 1)``)."""
        return (self.makespan - self.ideal) / self.makespan


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ScheduleError(message)


class _Sim:
    def __init__(self, lists: list[list[Instruction]], virtual_stages: int, train: bool,
                 forward_cost: float, backward_cost: float, weight_cost: float | None = None) -> None:
        self.p, self.v, self.train = len(lists), virtual_stages, train
        #: per stage: whether its backward is split (it has WeightGrad instructions)
        self.split = [any(isinstance(ins, WeightGrad) for ins in lst) for lst in lists]
        weight = (backward_cost / 2 if weight_cost is None else weight_cost) if any(self.split) else 0.0
        self.costs = {Forward: forward_cost / virtual_stages, Backward: (backward_cost - weight) / virtual_stages,
                      WeightGrad: weight / virtual_stages}
        self.progs = [steps(lst) for lst in lists]
        p = self.p
        self.pc, self.matched = [0] * p, [set() for _ in range(p)]
        self.clock, self.busy, self.match_time = [0.0] * p, [0.0] * p, [0.0] * p
        self.loaded, self.fwd, self.bwd, self.wgrad = ([set() for _ in range(p)] for _ in range(4))
        self.got_act, self.got_grad = [set() for _ in range(p)], [set() for _ in range(p)]
        self.live, self.peak = [0] * p, [0] * p

    def current(self, s: int):
        return self.progs[s][self.pc[s]] if self.pc[s] < len(self.progs[s]) else None

    def is_first(self, s: int, chunk: int) -> bool:
        return s == 0 and chunk == 0

    def is_last(self, s: int, chunk: int) -> bool:
        return s == self.p - 1 and chunk == self.v - 1

    def peer(self, s: int, chunk: int, delta: int) -> tuple[int, int]:
        """Where a send from chunk ``chunk`` of stage ``s`` lands: (stage, chunk)."""
        t = s + delta
        if 0 <= t < self.p:
            return t, chunk
        return t % self.p, chunk + delta  # round the ring: the next (or previous) chunk

    # ---- compute
    def compute(self, s: int, ins: Instruction) -> None:
        slot = (ins.chunk, ins.mb)
        if isinstance(ins, LoadMicroBatch):
            _check(self.is_first(s, ins.chunk) or self.is_last(s, ins.chunk), f"stage {s} loads data for {ins}")
            self.loaded[s].add(slot)
        elif isinstance(ins, Forward):
            _check(slot not in self.fwd[s], f"stage {s} forwards {slot} twice")
            if self.is_first(s, ins.chunk) or self.is_last(s, ins.chunk):
                _check(slot in self.loaded[s], f"stage {s} forwards {ins} before loading it")
            if not self.is_first(s, ins.chunk):
                _check(slot in self.got_act[s], f"stage {s} forwards {ins} before receiving it")
            self.fwd[s].add(slot)
            if self.train:
                self.live[s] += 1
                self.peak[s] = max(self.peak[s], self.live[s])
        elif isinstance(ins, Backward):
            _check(slot in self.fwd[s] and slot not in self.bwd[s], f"stage {s}: bad backward {ins}")
            if not self.is_last(s, ins.chunk):
                _check(slot in self.got_grad[s], f"stage {s} runs {ins} before its gradient")
            self.bwd[s].add(slot)
            self.live[s] -= 1
        elif isinstance(ins, WeightGrad):
            _check(slot in self.bwd[s] and slot not in self.wgrad[s], f"stage {s}: bad weight gradient {ins}")
            self.wgrad[s].add(slot)
        cost = self.costs.get(type(ins), 0.0)
        self.clock[s] += cost
        self.busy[s] += cost

    def run_computes(self) -> bool:
        moved = False
        for s in range(self.p):
            while (ins := self.current(s)) is not None and not isinstance(ins, list):
                self.compute(s, ins)
                self.pc[s] += 1
                self.match_time[s] = self.clock[s]
                moved = True
        return moved

    # ---- communication
    def match(self) -> bool:
        moved = False
        for s in range(self.p):
            ex = self.current(s)
            if not isinstance(ex, list):
                continue
            for j, op in enumerate(ex):
                if j not in self.matched[s] and type(op) in _SENDS:
                    moved |= self.match_send(s, j, op)
        return moved

    def match_send(self, s: int, j: int, op: Instruction) -> bool:
        delta, recv_type = _SENDS[type(op)]
        _check(not (self.is_last(s, op.chunk) if delta > 0 else self.is_first(s, op.chunk)),
               f"stage {s} sends {op} to no one")
        _check((op.chunk, op.mb) in (self.fwd[s] if delta > 0 else self.bwd[s]),
               f"stage {s} sends {op} before computing it")
        peer, chunk = self.peer(s, op.chunk, delta)
        pex = self.current(peer)
        if not isinstance(pex, list):
            return False
        for k, rop in enumerate(pex):
            if k not in self.matched[peer] and type(rop) is recv_type:
                _check((rop.chunk, rop.mb) == (chunk, op.mb),
                       f"order mismatch: stage {s} {op} meets stage {peer} {rop}")
                self.matched[s].add(j)
                self.matched[peer].add(k)
                (self.got_act if delta > 0 else self.got_grad)[peer].add((chunk, op.mb))
                at = max(self.clock[s], self.clock[peer])
                self.match_time[s] = max(self.match_time[s], at)
                self.match_time[peer] = max(self.match_time[peer], at)
                return True
        return False

    def complete_exchanges(self) -> bool:
        moved = False
        for s in range(self.p):
            ex = self.current(s)
            ops = [op for op in ex if isinstance(op, COMM)] if isinstance(ex, list) else []
            if isinstance(ex, list) and len(self.matched[s]) == len(ops):
                for op in ex:  # the overlapped work, after the operations were posted at clock[s]
                    if not isinstance(op, COMM):
                        self.compute(s, op)
                self.pc[s] += 1
                self.matched[s] = set()
                self.clock[s] = max(self.match_time[s], self.clock[s])
                moved = True
        return moved

    def run(self) -> None:
        while any(self.current(s) is not None for s in range(self.p)):
            moved = self.run_computes()
            moved = self.match() or moved
            moved = self.complete_exchanges() or moved
            if not moved:
                raise Deadlock("no stage can move: " + "; ".join(
                    f"stage {s} at {self.current(s)}" for s in range(self.p)))

    def check_complete(self, micro_batches: int) -> None:
        every = {(c, mb) for c in range(self.v) for mb in range(micro_batches)}
        for s in range(self.p):
            _check(self.fwd[s] == every, f"stage {s} forwarded {sorted(self.fwd[s])}")
            _check(self.bwd[s] == (every if self.train else set()), f"stage {s} backwarded {sorted(self.bwd[s])}")
            _check(not self.split[s] or self.wgrad[s] == self.bwd[s],
                   f"stage {s} computed weight gradients of {sorted(self.wgrad[s])}, backwarded {sorted(self.bwd[s])}")


def simulate(lists: list[list[Instruction]], virtual_stages: int = 1, train: bool = True,
             forward_cost: float = 1.0, backward_cost: float = 2.0, weight_cost: float | None = None) -> SimResult:
    """Run one instruction list per stage together (see the module docstring); raises
    :class:`Deadlock` or :class:`ScheduleError` for a schedule that cannot run. ``weight_cost``:
    the part of ``backward_cost`` a ``WeightGrad`` takes (half of it by default)."""
    sim = _Sim(lists, virtual_stages, train, forward_cost, backward_cost, weight_cost)
    sim.run()
    m = max((ins.mb for lst in lists for ins in lst), default=-1) + 1
    sim.check_complete(m)
    per_mb = forward_cost + (backward_cost if train else 0.0)
    return SimResult(sim.peak, max(sim.clock, default=0.0), sim.busy, m * per_mb)


def simulate_schedule(make: Callable[..., list[Instruction]], num_stages: int, micro_batches: int,
                      virtual_stages: int = 1, **kwargs) -> SimResult:
    """``simulate`` the lists ``make(stage, num_stages, micro_batches[, virtual_stages])`` of
    every stage."""
    extra = (virtual_stages,) if virtual_stages != 1 else ()
    lists = [make(s, num_stages, micro_batches, *extra) for s in range(num_stages)]
    return simulate(lists, virtual_stages, **kwargs)
