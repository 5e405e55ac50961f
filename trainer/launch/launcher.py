"""Local multi-process launch, as Lightning does it.

When ``fit`` asks for N > 1 processes and no distributed environment exists, the calling process
becomes global rank 0 and starts ranks 1..N-1 by re-running the same command line (same script or
``-m`` module, same arguments) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
Code after ``fit`` therefore runs on every rank. Under Hydra the children reuse rank 0's output
directory instead of creating their own.

Failure handling: a watchdog thread in rank 0 polls the children. When one exits with an error its
traceback is already on the shared stderr; the watchdog kills the other ranks and ends rank 0 with
the same exit code, even if rank 0 sits blocked inside a collective. When rank 0's own error (a
peer's socket closing) comes first, the failed rank is named and still gives the job its exit code. Children die with rank 0
(``PR_SET_PDEATHSIG``), and rank 0 waits for them at exit, so a job never leaves ranks behind.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from ...strategies.environment import ProcessInfo
from .watchdog import STALL_EXIT_CODE


def _child_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        cmd = [sys.executable, "-m", name]
    elif sys.argv and sys.argv[0] and sys.argv[0] not in ("-c", "-") and os.path.exists(sys.argv[0]):
        cmd = [sys.executable, os.path.abspath(sys.argv[0])]
    else:
        raise RuntimeError(
            "devices > 1 needs a script to re-run for the other ranks, but this process was started "
            "interactively or with `python -c`. Put the code in a file, or launch it with torchrun.")
    return cmd + _hydra_job_argv(sys.argv[1:]) + _hydra_overrides()


def _hydra_config():
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    return HydraConfig.get() if HydraConfig.initialized() else None


def _hydra_job_argv(argv: list[str]) -> list[str]:
    """The command line the other ranks re-run: this one, except in a Hydra ``--multirun`` job,
    where it is the sweep's options (``--config-dir`` ...) without ``--multirun`` and with this
    job's overrides only: the ranks run the job, not the whole sweep again."""
    hc = _hydra_config()
    if hc is None:
        return list(argv)
    from hydra._internal.utils import get_args_parser
    from hydra.types import RunMode

    if hc.mode != RunMode.MULTIRUN:
        return list(argv)

    args, _ = get_args_parser().parse_known_args(list(argv))
    out = []
    for flag, value in (("--config-path", args.config_path), ("--config-name", args.config_name),
                        ("--config-dir", args.config_dir)):
        if value:
            out += [flag, value]
    return out + list(hc.overrides.task)


def _hydra_overrides() -> list[str]:
    """Make Hydra in the children write into rank 0's run directory, not a fresh one each."""
    hc = _hydra_config()
    if hc is None:
        return []
    out_dir = hc.runtime.output_dir
    return [f"hydra.run.dir={out_dir}", "hydra.output_subdir=null", "hydra/job_logging=none",
            "hydra/hydra_logging=none"]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _job_code(code: int) -> int:
    """The job's exit status for a rank's: its own, or 1 for a rank ended by a signal."""
    return code if code > 0 else 1


#: how long rank 0, failing because a peer closed its connection, waits for that peer to exit
PEER_EXIT_WAIT_S = 10.0
#: what gloo's error says when the rank at the other end of a connection went away
_PEER_LOSS = ("closed by peer", "reset by peer", "Broken pipe")


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank's process went away."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOSS)


def describe_exit(rank: int, code: int) -> str:
    """``rank 1 was killed by signal 9 (SIGKILL)`` / ``rank 1 exited with code 3``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"rank {rank} was killed by signal {-code} ({name})"
    if code == STALL_EXIT_CODE:
        return f"rank {rank} was ended by the progress watchdog (exit code {code}; its message is above)"
    if code == 0:
        return f"rank {rank} had exited with code 0 before rank 0's fit ended"
    return f"rank {rank} exited with code {code} (its traceback, if Python raised one, is above)"


#: when the watch thread finds a rank dead, how long the ranks dying with it get to be reaped and
#: named (the failing rank may end after the peer its exit broke: it runs its exception handling)
WATCH_GRACE_S = 2.0
#: set in rank 0 only while a stage runs: a Trainer leaves no variables behind beyond the ones
#: Lightning's launcher leaves (MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK); between stages the
#: process group, which lives until exit, tells a later Trainer that it is a rank of this job
_STAGE_ONLY_ENV = ("LOCAL_WORLD_SIZE", "ZEROTRAIN_LAUNCHED")


class LocalLauncher:
    def __init__(self, info: ProcessInfo) -> None:
        self.info = info
        self.children: list[subprocess.Popen] = []
        self._stop = threading.Event()
        #: the exit status of the first rank found to have failed: the job ends with it (at exit)
        self.failed_code: int | None = None
        self._watcher: tuple[threading.Thread, threading.Event] | None = None  # ``watch``
        #: rank 0's variables for the length of a stage (``watch``/``unwatch``), and what they replaced
        self._stage_env: dict[str, str] = {}
        self._saved_env: dict[str, str | None] = {}

    def launch(self) -> ProcessInfo:
        """Start ranks 1..N-1; returns rank 0's ProcessInfo."""
        info = self.info
        cmd = _child_command()
        base = dict(os.environ)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        base.update(MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
                    WORLD_SIZE=str(info.world_size), LOCAL_WORLD_SIZE=str(info.world_size),
                    GROUP_RANK="0", ZEROTRAIN_LAUNCHED="1")
        base.setdefault("OMP_NUM_THREADS", str(max(1, cores // info.world_size)))
        for rank in range(1, info.world_size):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            self.children.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
        # rank 0 describes itself with the same variables, for user code that reads them; the ones
        # Lightning's launcher does not leave behind are set only while a stage runs (``watch``)
        os.environ.update({k: base[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")})
        os.environ.update(RANK="0", LOCAL_RANK="0")
        self._stage_env = {k: base[k] for k in _STAGE_ONLY_ENV}
        self.watch()
        atexit.register(self.wait)
        return ProcessInfo(0, 0, info.world_size, info.world_size, 0, info.master_addr,
                           info.master_port, source="local")

    def watch(self) -> None:
        """Watch the other ranks from a thread while a stage runs: a rank that fails ends the job at
        once (rank 0 would otherwise wait for it in a collective). Started at launch and again at
        each later stage; ``unwatch`` ends it when the stage returns, so no thread of ours outlives
        ``fit``/``validate``/``test`` (a rank failing between stages is reported at exit, ``wait``)."""
        if self._stage_env and not self._saved_env:  # (watch runs at launch and again at the stage's start)
            self._saved_env = {k: os.environ.get(k) for k in self._stage_env}
            os.environ.update(self._stage_env)
        if self._watcher is None and not self._stop.is_set():
            done = threading.Event()
            thread = threading.Thread(target=self._watch, args=(done,), name="zerotrain-watchdog", daemon=True)
            self._watcher = (thread, done)
            thread.start()

    def unwatch(self) -> None:
        for key, value in self._saved_env.items():  # the variables as they were before the stage
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        self._saved_env = {}
        if self._watcher is not None:
            thread, done = self._watcher
            self._watcher = None
            done.set()
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def _watch(self, done: threading.Event) -> None:
        while not self._stop.is_set() and not done.is_set():
            for rank, proc in enumerate(self.children, start=1):
                code = proc.poll()
                if code not in (None, 0):
                    # the rank reaped first may be an innocent peer, ended by the failing rank's exit
                    # (a gloo "Connection closed by peer"): the ranks dying with it are named too
                    self.kill(grace_s=WATCH_GRACE_S)
                    os._exit(self.failed_code if self.failed_code is not None else _job_code(code))
            done.wait(0.1)

    @staticmethod
    def _report(rank: int, code: int) -> None:
        sys.stderr.write(f"\n[zerotrain] {describe_exit(rank, code)}; ending the job.\n")
        sys.stderr.flush()

    def kill(self, report: bool = True, in_fit: bool = False, peer_lost: bool = False, grace_s: float = 0.5) -> None:
        """End every rank this process started. ``report``: first say which ranks had already
        died and how (rank 0 usually fails *because* a peer died: a gloo "Connection reset by
        peer" says nothing about who), waiting up to a second for a dying peer to be reaped, or
        up to PEER_EXIT_WAIT_S when rank 0's own error says a peer closed its connection
        (``peer_lost``): that peer is on its way out, and a loaded machine can take seconds
        between its closing the group's sockets at exit and the process ending. ``in_fit`` (rank
        0 failed inside fit): a rank that exited with code 0 is named too, since it left before
        the job's fit was over."""
        if report and not self._stop.is_set():
            deadline = time.monotonic() + (PEER_EXIT_WAIT_S if peer_lost else 1.0)
            while time.monotonic() < deadline and all(p.poll() is None for p in self.children):
                time.sleep(0.05)
            # the first rank reaped may be an innocent peer that the failing one's exit broke (its
            # gloo error): the others dying at that moment get ``grace_s`` to be reaped and named too
            grace = time.monotonic() + grace_s
            while time.monotonic() < grace and any(p.poll() is None for p in self.children):
                time.sleep(0.05)
            for rank, proc in enumerate(self.children, start=1):
                if proc.poll() is not None and (proc.returncode != 0 or in_fit):
                    self._report(rank, proc.returncode)
                    if proc.returncode != 0 and self.failed_code is None:
                        self.failed_code = _job_code(proc.returncode)
        self._stop.set()
        for proc in self.children:
            if proc.poll() is None:
                proc.kill()
        for proc in self.children:
            proc.wait()

    def wait(self, timeout: float = 600.0) -> None:
        """At rank 0's exit: let the other ranks finish the code after ``fit``, then reap them. A
        rank that failed first gives the job its exit status, as when the watchdog thread sees it
        first: rank 0's own error (gloo's "Connection reset by peer") only followed from it."""
        deadline = time.monotonic() + timeout
        for proc in self.children:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        self.kill()
        if self.failed_code is not None:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self.failed_code)
