"""Restarting a job after a failure, with torch's elastic agent.

``Trainer(max_restarts=K)`` on a plain ``python train.py`` run: the calling process does not train.
It becomes a ``torch.distributed.launcher.api.elastic_launch`` agent
(``LocalElasticAgent`` underneath) that starts ``devices`` worker processes re-running the same
command line, watches them, and when any of them dies (an exception, ``kill -9``, an OOM kill) stops
the others and starts them all again, up to K times. It then exits with the job's status, so the
script's code after ``fit`` runs in the workers only (as under torchrun). The workers see torchrun's
variables (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``...), which is also exactly what
``torchrun --max-restarts K train.py`` gives them: both ways behave the same.

Resuming: a worker whose ``TORCHELASTIC_RESTART_COUNT`` is above 0 resumes from the ``latest``
checkpoint of its ``ModelCheckpoint`` directory if there is one (whatever ``ckpt_path`` says, since
``latest`` is newer than anything this job started from), and from ``ckpt_path`` (or from scratch)
otherwise. ``fit(ckpt_path="latest")`` asks for the same on a first start.

Detecting a lost peer: the agent sees a dead worker on its own node within ``monitor_interval``.
For a peer that hangs, or one on another node, the collectives' timeout decides; it stays long
during set-up and the first step (which may compile or allocate for minutes) and is lowered to
``collective_timeout_s`` (default 60 s when restarts are on) after the first optimizer step with
``torch.distributed.distributed_c10d._set_pg_timeout``. Saves run under the long timeout again,
since the slowest rank's shard write bounds how long the others wait.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import uuid
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...strategies.environment import ProcessInfo, default_backend, free_port, init_default_group

log = logging.getLogger("zerotrain")

DEFAULT_RESTART_TIMEOUT_S = 60.0


def restart_count() -> int:
    """How many times the elastic agent has restarted this worker's group (0: first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarts_enabled(max_restarts: int) -> bool:
    return max_restarts > 0 or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def set_collective_timeout(seconds: float) -> bool:
    """Set the default process group's collective timeout; False when torch cannot."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not (dist.is_available() and dist.is_initialized()):
        return False
    setter(datetime.timedelta(seconds=seconds))
    return True


@contextlib.contextmanager
def timeout_during(strategy: Any, seconds: float | None) -> Iterator[None]:
    """Run the body under ``seconds`` (e.g. the long set-up timeout during a save), then return to
    the lowered one. No-op when the timeout was never lowered."""
    lowered = getattr(strategy, "_zt_lowered_timeout_s", None)
    if lowered is None or seconds is None or not strategy.distributed:
        yield
        return
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(lowered)


def lower_after_first_step(strategy: Any, seconds: float | None) -> None:
    if seconds is None or not strategy.distributed or getattr(strategy, "_zt_lowered_timeout_s", None):
        return
    if set_collective_timeout(seconds):
        strategy._zt_lowered_timeout_s = seconds
        log.info("collective timeout lowered to %.0f s after the first step", seconds)


def join_attempt_group(info: ProcessInfo, device: torch.device, timeout_s: float) -> None:
    """Join the default process group through a store prefixed with the restart attempt.

    Under torchelastic the workers of every attempt meet in the agent's one TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and torch 2.13 adds no per-attempt prefix to it: a
    restarted rank could read a dead rank's gloo address left from the previous attempt and fail
    with "connectFullMesh ... Connection refused". Afterwards the strategy finds the group made.
    No-op outside torchelastic, for one process, or when a group exists."""
    env = os.environ
    if (info.world_size == 1 or dist.is_initialized() or info.source != "torchrun"
            or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), info.world_size, is_master=False,
                          timeout=timeout)
    store = dist.PrefixStore(f"zerotrain/attempt_{restart_count()}/", store)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    init_default_group(backend=default_backend(device), store=store, rank=info.global_rank,
                       world_size=info.world_size, timeout=timeout, **kwargs)


class ElasticLauncher:
    """Runs the current command line as ``info.world_size`` workers under torch's elastic agent."""

    def __init__(self, info: ProcessInfo, max_restarts: int, monitor_interval: float = 0.5) -> None:
        if max_restarts < 1:
            raise ValueError(f"max_restarts={max_restarts!r} must be >= 1 to use the elastic launcher")
        self.info, self.max_restarts, self.monitor_interval = info, max_restarts, monitor_interval

    def run(self) -> int:
        """Start the workers and supervise them; returns the job's exit code (0: success)."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        from .launcher import _child_command

        cmd = _child_command()
        n = self.info.world_size
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))
        os.environ.pop("ZEROTRAIN_LAUNCHED", None)
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"zerotrain-{uuid.uuid4().hex[:8]}",
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
                              max_restarts=self.max_restarts, monitor_interval=self.monitor_interval,
                              start_method="spawn")
        log.info("elastic launch: %d worker(s), up to %d restart(s): %s", n, self.max_restarts, " ".join(cmd))
        try:
            elastic_launch(config, cmd[0])(*cmd[1:])
        except ChildFailedError as exc:
            sys.stderr.write(f"\n[zerotrain] the job failed after {self.max_restarts} restart(s):\n{exc}\n")
            sys.stderr.flush()
            return 1
        return 0
