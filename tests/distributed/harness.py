"""Run a function on N real processes over gloo, failing fast.

``run_ranks("module:function", world_size, tmp_path, **kwargs)`` starts one Python process per rank
with the standard variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set, as torchrun
would, and returns each rank's return value (saved with torch.save, loaded with weights_only=True).

Starting: each rank is forked from the pytest process's zygote (``zygote.py``), a server that has
imported torch, ``torch._dynamo`` and zerotrain once, which saves ~5 s of imports per rank; the
forked rank gets its own session, environment, directory, argv, log and random seeds, and runs the
exit handlers when it ends. ``fresh=True`` (or ``ZT_TEST_FRESH=1``, or an environment that differs
from the zygote's in a variable read at start-up) starts new interpreters instead, as torchrun
would: for what only a process that imported nothing yet shows (test_shutdown.py).

Rendezvous: ``init_dist`` and ``set_up_like_trainer`` join the group through a ``FileStore`` in
``tmp_path`` (``ZT_TEST_RENDEZVOUS``, one file per spawn) and bind no port. A target that runs the
real Trainer (or calls ``strategy.setup_environment()`` itself) goes through zerotrain's own
detection (``ZEROTRAIN_LAUNCHED`` + env://), which needs MASTER_PORT: only those bind the probed
port, and for them another process can still take it between the probe and rank 0's bind.

Three timeouts keep a hang from costing more than seconds: the process group's own timeout
(``init_dist``), ``faulthandler.dump_traceback_later`` in each rank (a stuck rank prints its stack
and exits), and a parent deadline that kills every rank. The first rank to fail fails the test with
its output; the others are killed at once.

``save_checkpoint`` / ``load_checkpoint`` write and read a strategy's checkpoint through the
Trainer's own format and sequence (``trainer/checkpoint/protocol.py``), for tests that drive a strategy
by hand.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_TESTS = _HERE.parent


class RankFailed(AssertionError):
    pass


def timeout_scale() -> float:
    """How much slower than an idle machine this one is (``tests/conftest.py`` measures it once)."""
    return float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))


def _free_port() -> int:
    """A port free now (may be taken before it is bound): only for the Trainer's env:// rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pythonpath(env: dict[str, str]) -> str:
    return os.pathsep.join([str(_HERE), str(_TESTS), env.get("PYTHONPATH", "")])


# ---------------------------------------------------------------------------- starting a rank
#: variables a rank reads only once it runs (the zygote's ranks get them from the request): a
#: spawn whose environment differs from the zygote's in any other variable starts fresh processes
_RUNTIME_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "ZEROTRAIN_LAUNCHED", "OMP_NUM_THREADS", "PYTHONPATH",
                          "PYTEST_CURRENT_TEST", "ZEROTRAIN_TEST_TIMEOUT_SCALE", "TORCHINDUCTOR_CACHE_DIR",
                          "TRITON_CACHE_DIR"})


def needs_fresh(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a rank with ``env`` must start from nothing rather than fork from a zygote started
    with ``base``: some variable read at process start-up or import (``MALLOC_*``, a library's
    switch, ...) differs."""
    keys = (env.keys() | base.keys()) - _RUNTIME_ENV
    return any(env.get(k) != base.get(k) for k in keys if not k.startswith("ZT_TEST_"))


class _Forked:
    """A rank forked by the zygote, with the part of ``subprocess.Popen`` the harness uses."""

    def __init__(self, pid: int, rc: Path) -> None:
        self.pid, self._rc, self.returncode = pid, rc, None

    def poll(self) -> int | None:
        if self.returncode is None and self._rc.exists():
            self.returncode = int(self._rc.read_text())
        return self.returncode

    def wait(self, timeout: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.returncode


class _Zygote:
    """The pytest process's one zygote (``zygote.py``), started at the first spawn."""

    proc: subprocess.Popen | None = None
    path: str = ""
    base: dict[str, str] = {}

    @classmethod
    def start(cls) -> bool:
        if cls.proc is not None:
            return cls.proc.poll() is None
        import atexit
        import tempfile

        cls.path = os.path.join(tempfile.mkdtemp(prefix="zt-zygote-"), "sock")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath(os.environ))
        cls.base = dict(os.environ)
        cls.proc = subprocess.Popen([sys.executable, str(_HERE / "zygote.py"), cls.path], env=env,
                                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        atexit.register(cls.stop)
        ready = cls.proc.stdout.readline().strip() == "ready"  # imports: ~5 s
        if not ready:
            cls.stop()
        return ready

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.kill()
            cls.proc.wait()

    @classmethod
    def fork(cls, argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> _Forked:
        rc = log.with_suffix(".rc")
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log), "rc": str(rc)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(cls.path)
            conn.sendall((json.dumps(request) + "\n").encode())
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    raise RuntimeError("the test zygote closed the connection without forking")
                reply += chunk
        return _Forked(int(reply), rc)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # it ended between the poll and the signal
        pass


def _start_rank(argv: list[str], env: dict[str, str], log: Path, cwd: Path, fresh: bool) -> Any:
    """Fork the rank from the zygote, or (``fresh``, ``ZT_TEST_FRESH=1``, an environment the zygote
    was not started with) start a new interpreter, as torchrun would."""
    fresh = fresh or os.environ.get("ZT_TEST_FRESH") == "1"
    if not fresh and _Zygote.start() and not needs_fresh(env, _Zygote.base):
        return _Zygote.fork(argv, env, log, cwd)
    with open(log, "w") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(cwd),
                                start_new_session=True)


def run_ranks(target: str, world_size: int, tmp_path: Path, timeout: float = 120.0,
              env: dict[str, str] | None = None, fresh: bool = False, **kwargs: Any) -> list[Any]:
    import torch

    timeout = timeout * timeout_scale()
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    spawn = f"{os.getpid()}_{time.monotonic_ns()}"
    args_file = tmp_path / f"args_{spawn}.json"
    args_file.write_text(json.dumps(kwargs))
    port = _free_port()
    procs, logs = [], []
    for rank in range(world_size):
        e = dict(os.environ)
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                 LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), ZEROTRAIN_LAUNCHED="1", OMP_NUM_THREADS="1",
                 ZT_TEST_RESULT=str(tmp_path / f"result_{rank}.pt"), ZT_TEST_TIMEOUT=str(timeout),
                 ZT_TEST_RENDEZVOUS=str(tmp_path.resolve() / f"rendezvous_{spawn}"),
                 PYTHONPATH=_pythonpath(e))
        e.update(env or {})
        log = tmp_path / f"rank_{rank}.log"
        logs.append(log)
        procs.append(_start_rank([sys.executable, str(_HERE / "harness.py"), target, str(args_file)], e, log,
                                 tmp_path, fresh))
    deadline = time.monotonic() + timeout + 15
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = (bad[0], f"rank {bad[0]} exited with code {codes[bad[0]]}")
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                for p in procs:  # ask for stacks first
                    if p.poll() is None:
                        _killpg(p.pid, signal.SIGABRT)
                time.sleep(1)
                failed = (0, f"job did not finish within {timeout}s")
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _killpg(p.pid, signal.SIGKILL)
            p.wait()
    if failed:
        out = []
        for r, log in enumerate(logs):
            text = log.read_text(errors="replace") if log.exists() else "(no output)"
            out.append(f"----- rank {r} -----\n{text[-6000:]}")
        raise RankFailed(failed[1] + "\n" + "\n".join(out))
    return [torch.load(tmp_path / f"result_{r}.pt", weights_only=True) for r in range(world_size)]


def run_ranks_once(cache: dict, key: Any, target: str, world_size: int, tmp_path_factory,
                   **kwargs: Any) -> list[Any]:
    """``run_ranks`` once per ``key`` for a module's tests that share one spawn; a failure is
    cached too and re-raised in each test that asks."""
    if key not in cache:
        try:
            cache[key] = run_ranks(target, world_size, tmp_path_factory.mktemp(f"w{world_size}_"), **kwargs)
        except Exception as e:  # noqa: BLE001 - cached and re-raised per test
            cache[key] = e
    if isinstance(cache[key], Exception):
        raise cache[key]
    return cache[key]


def set_up_like_trainer(strategy: Any, module: Any, info: Any, precision: Any) -> tuple[Any, Any]:
    """Drive a strategy through the Trainer's set-up order on CPU; returns what
    ``module.configure_optimizers()`` returned (optimizer, scheduler)."""
    import torch

    strategy.connect(info, torch.device("cpu"), precision)
    if info.world_size > 1:  # meet through the spawn's file; setup_environment then finds the group
        init_dist(strategy.process_group_timeout_s)
    strategy.setup_environment()
    strategy.configure_model(module)
    strategy.setup_module(module)
    opt, sched = module.configure_optimizers()
    strategy.setup_optimizer(opt)
    return opt, sched


def save_checkpoint(strategy: Any, path: str | os.PathLike, scheduler: Any = None) -> Path:
    """Collective: write ``strategy``'s checkpoint to the directory ``path`` as
    ``Trainer.save_checkpoint`` does (``trainer/checkpoint/protocol.py`` ``save_strategy``), for tests that
    drive a strategy without a Trainer. The loop state is empty; ``scheduler``'s state goes in the
    metadata when given. Returns the checkpoint directory."""
    from zerotrain.trainer.checkpoint import protocol as checkpointing

    def loop_meta(meta: dict[str, Any]) -> None:
        meta.update(loop={}, scheduler=scheduler.state_dict() if scheduler is not None else None)

    return checkpointing.save_strategy(strategy, strategy.optimizer, path, loop_meta, update_latest=False)


def load_checkpoint(strategy: Any, path: str | os.PathLike, scheduler: Any = None) -> dict[str, Any]:
    """Collective: load a checkpoint into ``strategy`` as ``Trainer.fit(ckpt_path=...)`` does
    (``trainer/checkpoint/protocol.py`` ``load_strategy``), and ``scheduler``'s state when given. Returns
    the checkpoint's metadata."""
    from zerotrain.trainer.checkpoint import protocol as checkpointing

    meta = checkpointing.load_strategy(strategy, strategy.optimizer, path)
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    strategy.barrier()
    return meta


_joins = 0  # groups this process has joined: each join meets in a file of its own


def init_dist(timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the gloo process group from the harness's variables; returns (rank, world_size).

    The ranks meet through a FileStore under the spawn's tmp_path (no port to race for). A
    process that destroys its group and joins again gets a new file (every rank joins in the
    same order), so it never meets the old group's keys. Without the harness's variables (a
    worker started by torchrun, say) it falls back to env://."""
    global _joins
    import torch.distributed as dist

    from zerotrain.strategies.environment import init_default_group

    if not dist.is_initialized():
        kwargs = {}
        if "ZT_TEST_RENDEZVOUS" in os.environ:
            _joins += 1
            kwargs = dict(init_method=f"file://{os.environ['ZT_TEST_RENDEZVOUS']}.{_joins}",
                          rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        init_default_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()


def _child(target: str, args_file: str) -> None:
    import faulthandler
    import importlib

    import torch

    faulthandler.dump_traceback_later(float(os.environ["ZT_TEST_TIMEOUT"]), exit=True)
    faulthandler.enable(all_threads=True)  # SIGABRT from the parent prints every stack
    torch.set_num_threads(1)
    module_name, func_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), func_name)
    result = fn(**json.loads(Path(args_file).read_text()))
    torch.save(result, os.environ["ZT_TEST_RESULT"])
    if os.environ.get("ZT_TEST_HARD_EXIT") == "1":
        # a reference run under another library (Lightning's DDP keeps its process group alive
        # into interpreter finalization, where gloo's threads can abort the process): its record
        # is written, and its teardown is not what the test checks
        sys.stdout.flush()
        os._exit(0)
    import torch.distributed as dist
    if dist.is_initialized():
        time.sleep(0.2)  # let gloo's workers drop finished work first (environment._let_workers_settle)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path[:0] = [str(_HERE), str(_TESTS)]
    _child(sys.argv[1], sys.argv[2])
