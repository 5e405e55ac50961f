"""SIGTERM (and SIGUSR1 under SLURM): every rank saves a checkpoint at the next step boundary,
then the run exits cleanly; ``fit(ckpt_path="last")`` continues it exactly.

What happens, in order:

1. ``fit`` installs a handler for SIGTERM (and, in a SLURM batch job, SIGUSR1: Lightning's
   auto-requeue signal) in each rank's main thread, after the set-up, chaining whatever handler
   the user had installed (it is called after ours); the previous handlers are put back when
   ``fit`` ends. The handler only records the signal (nothing that could deadlock inside a
   signal handler). Our launcher's rank 0 forwards a SIGTERM it receives to the ranks it started,
   as Lightning's launcher does; torchrun forwards SIGTERM to its workers itself.
2. After every optimizer step (after that step's validation, if any), the ranks agree on whether
   any of them received a signal: one all-reduce of one number, only with several processes.
   Why a collective and not the watchdog's c10d store: the ranks must stop at the *same* step,
   and only a collective on the step path gives that without a second round of negotiation; the
   step already synchronises the ranks, so one scalar more costs one latency, the same as
   Lightning's per-batch SIGTERM broadcast (ours also hears a signal sent to any rank, not only
   to rank 0).
3. If one did: every rank logs it, and together they save a full checkpoint named
   ``sigterm-step=NNNNNN`` (``sigusr1-...``) in the first ModelCheckpoint's ``dirpath``
   (``default_root_dir/checkpoints`` without one), moving its ``latest`` pointer there; under
   SLURM after SIGUSR1, global rank 0 then runs ``scontrol requeue <job id>``. Then each rank
   raises :class:`SIGTERMException`, a ``SystemExit`` without a code as Lightning's: callbacks'
   ``on_exception`` see it, ``fit`` tears down, and the process exits with status 0.
4. A signal that arrives after the last step (the final validation, ``on_fit_end``) finds the
   run finished and its checkpoints written: ``fit`` completes, then raises the exception too,
   since the process was asked to end.

A rank started by our launcher whose parent (rank 0) has died also gets SIGTERM (the launcher's
parent-death signal): that one still ends the process at once, as before. So does a SIGTERM
that follows a first one by REPEAT_AFTER_S or more while no step boundary came (a rank stuck in
its step never reaches one): the rank forwards it to the ranks it started, says so, and ends
without the checkpoint. One sooner is taken for the first delivered again (a signal sent to the
whole process group also reaches a rank through rank 0's forwarding).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..loop.trainer import Trainer

log = logging.getLogger("zerotrain")

#: a SIGTERM this long (seconds) after the first one, while no step boundary has come, ends the
#: rank at once; sooner, it is the first one again (sent to the process group and forwarded)
REPEAT_AFTER_S = 5.0


class SIGTERMException(SystemExit):
    """Raised on every rank once the signal's checkpoint is saved (a ``SystemExit``: exit status
    0 when nobody catches it), as Lightning's ``SIGTERMException``."""


def under_slurm() -> bool:
    """A SLURM batch job (not an interactive ``salloc`` shell), where SIGUSR1 means requeue."""
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def handled_signals() -> list[signal.Signals]:
    return [signal.SIGTERM] + ([signal.SIGUSR1] if under_slurm() else [])


class SignalCheckpoint:
    """One ``fit``'s signal handling (module docstring)."""

    def __init__(self, trainer: "Trainer", launcher: Any = None) -> None:
        self.trainer = trainer
        self.launcher = launcher  # our LocalLauncher on rank 0 of a job it started: the signal goes on to its ranks
        self.received: int | None = None  # this rank's first signal
        self._previous: dict[int, Any] = {}
        self._parent = os.getppid()
        self._first_at = 0.0  # when the first signal came (monotonic)
        self._saving = False  # the signal's checkpoint is being written: a SIGTERM then waits for it

    # ------------------------------------------------------------------ the handlers
    def install(self) -> None:
        """Main thread only (Python allows no other); a Trainer run elsewhere still takes part
        in the agreement, it just hears no signal itself."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in handled_signals():
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGTERM and self._orphaned():
            signal.signal(signum, signal.SIG_DFL)  # rank 0 died: end now, as without this handler
            os.kill(os.getpid(), signum)
            return
        first = self.received is None
        if (signum == signal.SIGTERM and self.received == signal.SIGTERM and not self._saving
                and time.monotonic() - self._first_at >= REPEAT_AFTER_S):
            # asked again, well after the first (not the same signal delivered twice, to the group
            # and forwarded by rank 0), and no step boundary came: a stuck step; end now
            os.write(2, f"\n[zerotrain] rank {self.trainer.global_rank}: SIGTERM again, {REPEAT_AFTER_S:g} s or "
                        "more after the first, and no step boundary came; ending now, without the "
                        "signal's checkpoint\n".encode())
            self._forward(signum)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if first:
            self.received, self._first_at = signum, time.monotonic()
            self._forward(signum)
        previous = self._previous.get(signum)
        if callable(previous):  # the user's own handler, chained
            previous(signum, frame)

    def _orphaned(self) -> bool:
        """A rank our launcher started, whose parent (rank 0) is gone: the parent-death signal."""
        return os.environ.get("ZEROTRAIN_LAUNCHED") == "1" and self.trainer.global_rank != 0 and \
            os.getppid() != self._parent

    def _forward(self, signum: int) -> None:
        """Rank 0 of our launcher: the same signal to the ranks it started."""
        launcher = self.launcher
        for proc in (launcher.children if launcher is not None and signum == signal.SIGTERM else []):
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ the step boundary
    def agreed(self) -> int:
        """Collective (several processes): the signal any rank received (the highest number
        when they differ), or 0."""
        s = self.trainer.strategy
        mine = float(self.received or 0)
        return int(s.reduce(mine, op="max").item()) if s.distributed else int(mine)

    def at_step_boundary(self) -> None:
        """After each optimizer step, on every rank together."""
        signum = self.agreed()
        if signum:
            self.checkpoint_and_exit(signum)

    def checkpoint_and_exit(self, signum: int) -> None:
        """Every rank: save the checkpoint, requeue under SLURM after SIGUSR1, then raise."""
        t = self.trainer
        self._saving = True
        name = signal.Signals(signum).name
        if self.received is not None:
            log.warning("rank %d: received %s", t.global_rank, signal.Signals(self.received).name)
        path = os.path.join(checkpoint_dir(t), f"{name.lower()}-step={t.global_step:06d}")
        if t.is_global_zero:
            log.warning("%s: saving a checkpoint at step %d (epoch %d) to %s, then exiting; resume with "
                        "fit(ckpt_path='last')", name, t.global_step, t.current_epoch, path)
        t.save_checkpoint(path)
        if signum == signal.SIGUSR1 and t.is_global_zero and under_slurm():
            requeue()
        raise SIGTERMException()

    def finished(self) -> None:
        """After a complete ``fit``: a signal received late still ends the process (step 4)."""
        signum = self.agreed()
        if signum:
            if self.trainer.is_global_zero:
                log.warning("%s received after the last step: fit completed and its checkpoints are written; "
                            "exiting", signal.Signals(signum).name)
            if signum == signal.SIGUSR1 and self.trainer.is_global_zero and under_slurm():
                requeue()
            raise SIGTERMException()


def checkpoint_dir(trainer: "Trainer") -> str:
    from ...callbacks.checkpoint import ModelCheckpoint

    dirs = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    return dirs[0] if dirs else os.path.join(trainer.default_root_dir, "checkpoints")


def slurm_job_id() -> str:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]


def requeue() -> None:
    """Lightning's auto-requeue: ``scontrol requeue <job id>`` (an array task as ``JOB_TASK``)."""
    job = slurm_job_id()
    if not job.replace("_", "").isdigit():
        log.warning("SLURM job id %r is not a job number; not requeuing", job)
        return
    try:
        code = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        log.warning("scontrol is not on PATH: SLURM job %s was not requeued", job)
        return
    if code == 0:
        log.info("requeued SLURM job %s", job)
    else:
        log.warning("requeuing SLURM job %s failed: scontrol exited with code %d", job, code)
