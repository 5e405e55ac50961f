"""The progress watchdog: a rank that stops making progress while the others wait ends the job
within seconds, naming itself, its last step and its Python stack.

Why: a rank stuck in user code (or in a forward that only it runs, the classic ZeRO-3 trap) leaves
the other ranks blocked inside a collective until the process group's timeout, minutes later,
with a message that names no rank. Collective timeouts cannot say *who* is late; progress can.

How: the Trainer calls :meth:`ProgressWatchdog.tick` at every phase of the loop (batch start,
training step, backward, optimizer step, hooks, validation batches). Every rank runs the phases
in the same order, so the tick count says how far a rank got. A side thread in each rank publishes
``(ticks, step, phase, seconds since the last tick)`` to the job's c10d store once a second and
reads everyone else's. A rank that has not ticked for ``timeout_s`` while another rank that has
ticked more often has waited for ``timeout_s`` too is the one the others wait for: its own
watchdog prints its stack and ends the process, and every other rank ends a few seconds later (so no launcher has to notice anything: this works
the same under our launcher, torchrun, SLURM and a user's process group).

When every rank stands still at the same tick (a long optimizer step with NVMe offload, a save),
nobody waits for anybody: that is slow work, not a stall, and the watchdog leaves it alone.

The watchdog arms when the fit loop begins (after set-up, checkpoint loading and the fit-start
hooks, before the sanity check) and is disarmed when it ends. Until a rank's first optimizer step
(the sanity check, the first step, which builds kernels, compiles and warms caches, at different
speeds on different ranks) that rank may stand still for ``first_timeout_s`` (6x ``timeout_s``:
2 minutes by default) instead of ``timeout_s``: a rank stuck before its first step ends the job
then, named, not at the process group's timeout (5 minutes by default, naming no rank).
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

from .stopped_parent import StoppedParentGuard, under_our_launcher

log = logging.getLogger("zerotrain")

#: exit status of a rank (and a job under our launcher) ended by the watchdog: its own, so that it
#: is not mistaken for ``timeout(1)`` killing the job (124-127, 137), a signal (128 + n), Python's
#: 1 / 120, the CLI's configuration error (2) or a sysexits.h code (64-78; 75 = "retry later" asks
#: some schedulers to requeue)
STALL_EXIT_CODE = 86
#: how long the other ranks give the stuck rank to print its stack before they end too
_GRACE_S = 5.0


#: a rank's progress is (phases reached, collectives issued in the current phase), as one number:
#: phases x MARKS_PER_PHASE + collectives
MARKS_PER_PHASE = 1_000_000
#: before a rank's first optimizer step it may stand still this many times ``timeout_s``
FIRST_STEP_FACTOR = 6.0


class Progress(NamedTuple):
    ticks: int
    step: int
    phase: str
    idle_s: float  # seconds since this rank's last tick, measured by that rank
    warm: bool = True  # this rank has made its first optimizer step of this fit

    def encode(self) -> bytes:
        return f"{self.ticks}|{self.step}|{self.idle_s:.3f}|{int(self.warm)}|{self.phase}".encode()

    @staticmethod
    def decode(raw: bytes) -> "Progress":
        ticks, step, idle, warm, phase = raw.decode().split("|", 4)
        return Progress(int(ticks), int(step), phase, float(idle), warm == "1")


def find_stuck(progress: dict[int, Progress], timeout_s: float, first_timeout_s: float | None = None) -> int | None:
    """The rank the others wait for, or None. Pure: the same answer on every rank.

    A rank is stuck when it has been idle for longer than its allowance and some rank that got
    further (more ticks) has itself stood still for longer than that: it has waited that long.
    The allowance is ``timeout_s``, or ``first_timeout_s`` (when given) for a rank before its
    first optimizer step. Among several, the one furthest behind (lowest rank on a tie). The rank
    ahead must have waited too, not only the one behind: a pipeline stage spends its whole
    schedule (every micro-batch's forward and backward) in one tick, and the other stage may
    issue the step's first collective moments before the first one finishes its last backward."""
    if len(progress) < 2:
        return None

    def allowed(p: Progress) -> float:
        return timeout_s if p.warm or first_timeout_s is None else first_timeout_s

    late = [(p.ticks, r) for r, p in progress.items() if p.idle_s > allowed(p)
            and any(q.ticks > p.ticks and q.idle_s > allowed(p) for q in progress.values())]
    return min(late)[1] if late else None


def _main_thread_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(no stack available)\n"


class ProgressWatchdog:
    """One rank's ticks, and the side thread that compares them with the other ranks'."""

    def __init__(self, rank: int, world_size: int, store: Any, timeout_s: float, key: str,
                 hint: Callable[[], str] = lambda: "", interval_s: float = 1.0) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.timeout_s, self.interval_s, self.hint = float(timeout_s), float(interval_s), hint
        self.first_timeout_s = FIRST_STEP_FACTOR * self.timeout_s
        self._warm = False
        self._keys = [f"{key}/{r}" for r in range(world_size)]
        self._count = itertools.count(1)  # next() is atomic: marks may come from autograd threads
        self._marks = itertools.count(1)  # the collectives issued in the current phase
        self._phase_n, self._ticks, self._step, self._phase = 0, 0, 0, "start"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value read, when first read)
        self._round_at = time.monotonic()  # when the thread last completed a round with the store
        self._guard: StoppedParentGuard | None = None  # a stopped rank 0 under our launcher

    # ------------------------------------------------------------------ the loop's side
    def tick(self, phase: str, step: int) -> None:
        """Called by the loop at each phase (each callback of a hook included): cheap, no I/O."""
        self._phase_n, self._marks = next(self._count), itertools.count(1)
        self._ticks = self._phase_n * MARKS_PER_PHASE
        self._phase, self._step, self._last = phase, step, time.monotonic()

    def mark(self, collective: str) -> None:
        """A world-wide collective is being issued (``strategies/progress.py``): progress within the
        loop's current phase. It counts for less than any phase: ranks that disagree on their
        collectives (a forward on one rank alone) issue different numbers of them, so only ranks in
        the same phase are compared by them; the rank in an earlier phase is the one behind."""
        self._ticks = self._phase_n * MARKS_PER_PHASE + min(next(self._marks), MARKS_PER_PHASE - 1)
        self._phase = f"{self._phase.split(' (')[0]} (last collective issued: {collective})"
        self._last = time.monotonic()

    def warmed(self) -> None:
        """This rank made its first optimizer step: from now on ``timeout_s`` applies to it."""
        self._warm = True

    def arm(self) -> None:
        """Start watching (idempotent): when the fit loop begins."""
        if self._thread is not None:
            return
        self.store.set(self._where_key(self.rank), f"{socket.gethostname()}|{os.getpid()}")
        self._publish()
        self._thread = threading.Thread(target=self._run, name="zerotrain-progress-watchdog", daemon=True)
        self._thread.start()
        if under_our_launcher(self.rank):  # rank 0 hosts the store: its stop stops our store calls
            self._guard = StoppedParentGuard(self.rank, self.timeout_s, STALL_EXIT_CODE,
                                             lambda: self._round_at, self.interval_s)
            self._guard.start()

    def disarm(self) -> None:
        self._stop.set()
        if self._guard is not None:
            self._guard.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval_s + 1)

    # ------------------------------------------------------------------ the thread's side
    def _mine(self) -> Progress:
        return Progress(self._ticks, self._step, self._phase, time.monotonic() - self._last, self._warm)

    def _publish(self) -> None:
        self.store.set(self._keys[self.rank], self._mine().encode())

    def _read(self) -> dict[int, Progress]:
        """Every armed rank's progress. A value that has not changed since we first read it means
        that rank's watchdog thread stopped publishing (it cannot get the GIL, say): its idle time
        then keeps growing on our clock."""
        present = [r for r, k in enumerate(self._keys) if self.store.check([k])]
        values = self.store.multi_get([self._keys[r] for r in present]) if present else []
        now, out = time.monotonic(), {}
        for r, raw in zip(present, map(bytes, values)):
            if r not in self._seen or self._seen[r][0] != raw:
                self._seen[r] = (raw, now)
            p = Progress.decode(raw)
            out[r] = p._replace(idle_s=p.idle_s + now - self._seen[r][1])
        return out

    def _where_key(self, rank: int) -> str:
        return f"{self._keys[rank]}/process"

    def _end_frozen(self, stuck: int) -> str:
        """SIGKILL the stuck rank when it cannot end itself: its own watchdog thread has published
        nothing for ``timeout_s`` (the process is stopped, ``SIGSTOP``, or its thread starved) and
        it runs on this host. A stopped process ignores everything else, even its launcher's
        SIGTERM or parent-death signal, and would outlive the job or keep it from ending (our
        launcher's rank 0 is the job's main process). Returns what was done, for the message."""
        seen = self._seen.get(stuck)
        if seen is None or time.monotonic() - seen[1] < self.timeout_s:
            return ""
        try:
            host, pid = bytes(self.store.get(self._where_key(stuck))).decode().split("|")
        except Exception:  # noqa: BLE001 - no record (an older rank) or the store is gone
            return ""
        if host != socket.gethostname() or int(pid) == os.getpid():
            return ""
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:  # already gone
            return ""
        return (f"[zerotrain] rank {self.rank}: rank {stuck} (pid {pid}) published nothing for "
                f"{time.monotonic() - seen[1]:.0f} s (stopped?) and cannot end itself: killed it (SIGKILL).\n")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
                progress = self._read()
                self._round_at = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: the job is ending anyway
                log.debug("progress watchdog stopped: %s", exc)
                return
            stuck = find_stuck(progress, self.timeout_s, self.first_timeout_s)
            if stuck is not None and not self._stop.is_set():
                self._end_job(stuck, progress)

    def _end_job(self, stuck: int, progress: dict[int, Progress]) -> None:
        p = progress[stuck]
        waiting = ", ".join(f"{r} (step {q.step}, in {q.phase})" for r, q in sorted(progress.items())
                            if q.ticks > p.ticks)
        if stuck == self.rank:
            hint = self.hint()
            first = "" if p.warm else ", before its first optimizer step"
            msg = (f"\n[zerotrain] rank {stuck} made no progress for {p.idle_s:.0f} s (last step {p.step}, "
                   f"in {p.phase}{first}) while rank(s) {waiting} wait for it; ending the job. "
                   f"Stack of rank {stuck}:\n{_main_thread_stack()}"
                   + (f"[zerotrain] hint: {hint}\n" if hint else "")
                   + f"[zerotrain] (a rank that legitimately works alone for longer than "
                   f"{self.timeout_s if p.warm else self.first_timeout_s:g} s: "
                   "raise Trainer(stall_timeout_s=...), or None to disable this watchdog)\n")
        else:
            msg = (f"\n[zerotrain] rank {self.rank}: rank {stuck} made no progress for {p.idle_s:.0f} s "
                   f"(last step {p.step}, in {p.phase}) while this rank waits for it; ending (rank "
                   f"{stuck} prints its stack).\n")
            time.sleep(_GRACE_S)  # let the stuck rank print first; a launcher may end us before
            msg += self._end_frozen(stuck)
        sys.stderr.write(msg)
        sys.stderr.flush()
        os._exit(STALL_EXIT_CODE)


def make_watchdog(strategy: Any, timeout_s: float | None, key: str) -> ProgressWatchdog | None:
    """A watchdog for this rank, or None for one process, ``timeout_s=None``, or no c10d store."""
    if timeout_s is None or not strategy.distributed:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception as exc:  # noqa: BLE001 - a process group without a store (rare): no watchdog
        log.warning("progress watchdog disabled: the process group has no c10d store (%s)", exc)
        return None
    return ProgressWatchdog(strategy.global_rank, strategy.world_size, store, timeout_s, key,
                            hint=strategy.stall_hint)
