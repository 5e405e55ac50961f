"""A stopped rank 0 under our launcher: the other ranks end the job, naming it.

Why: under our launcher rank 0 is the job's main process, the parent of every other rank, and it
hosts the job's c10d store. Stopped (``SIGSTOP``, a debugger), it can neither end itself (its own
watchdog thread is stopped with it) nor be noticed through the store: the store stops answering,
so the other ranks' progress watchdogs block inside a store call (TCPStore's ``check`` waits
without a bound for a stopped server) and their main threads inside a collective, until the
process group's timeout, minutes later, or for ever. No parent-death signal comes: the parent is
alive. The fault campaign (``bench/fault_campaign.py``) saw such jobs never end.

How: in each rank our launcher started, a side thread that never touches the store reads its
parent's state in ``/proc`` once a second. When the parent has been seen stopped (state ``T`` or
``t``) at every look for ``timeout_s`` (the stall timeout), and the progress watchdog's store
round has not completed since it was first seen so, the rank kills the parent with ``SIGKILL`` (a
stopped process ignores everything else), says so naming rank 0, and exits with the watchdog's
code. The other ranks then get their parent-death signal. Under torchrun, SLURM or a user's own
process group rank 0 is not the parent, and this thread is not started: there the store's host is
not the job's root, and the peers' own watchdogs end a stopped rank 0 (``watchdog._end_frozen``).

A whole job stopped at once (Ctrl-Z in the shell, which stops the process group) stops this
thread too; on ``fg`` the parent is seen running again at the next look, so it is left alone.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable


def process_state(pid: int) -> str | None:
    """The one-letter state in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` ...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def under_our_launcher(rank: int) -> bool:
    """A rank our launcher started: its parent is rank 0 (``trainer/launch/launcher.py``)."""
    return os.environ.get("ZEROTRAIN_LAUNCHED") == "1" and rank != 0


class StoppedParentGuard:
    """The side thread of one rank started by our launcher (module docstring)."""

    def __init__(self, rank: int, timeout_s: float, exit_code: int, last_round: Callable[[], float],
                 interval_s: float = 1.0) -> None:
        self.rank, self.timeout_s, self.exit_code = rank, float(timeout_s), exit_code
        self.interval_s, self.last_round = float(interval_s), last_round
        self.parent = os.getppid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="zerotrain-stopped-parent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        stopped_since: float | None = None
        while not self._stop.wait(self.interval_s):
            if os.getppid() != self.parent:  # rank 0 is gone: the parent-death signal ends us
                return
            now = time.monotonic()
            if process_state(self.parent) not in ("T", "t"):
                stopped_since = None
                continue
            stopped_since = now if stopped_since is None else stopped_since
            if now - stopped_since >= self.timeout_s and self.last_round() < stopped_since:
                self._end(now - stopped_since)

    def _end(self, stopped_s: float) -> None:
        try:
            os.kill(self.parent, signal.SIGKILL)
            done = "killed it (SIGKILL)"
        except OSError:  # gone meanwhile (another rank killed it)
            done = "it is gone"
        sys.stderr.write(
            f"\n[zerotrain] rank {self.rank}: rank 0 (pid {self.parent}, the launching process, which "
            f"hosts the job's store) has been stopped for {stopped_s:.0f} s and cannot end itself: "
            f"{done}; ending the job.\n")
        sys.stderr.flush()
        os._exit(self.exit_code)
