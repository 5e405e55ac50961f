"""Shared test set-up: tests/, tests/distributed/ and tests/kernels/ are importable by plain module
name, so that worker functions for multi-process tests can be found again in the child processes
(and no test imports through a package name an installed distribution may also own: transformers
5.25 installs a top-level ``kernels``); timeouts scale
with the machine's load; and every test fails that leaks environment variables, threads or an
initialised default process group into the tests after it (``fail_on_leaks``)."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("", "distributed", "kernels"):
    path = os.path.join(_HERE, sub)
    if path not in sys.path:
        sys.path.insert(0, path)


def _load_scale() -> float:
    """Timeouts scale with the load: a test that takes 60 s alone takes ~2x as long while two busy
    processes share the 2 cores. Measured once per session as runnable tasks per core (1 on an
    idle machine); ZEROTRAIN_TEST_TIMEOUT_SCALE overrides it."""
    if "ZEROTRAIN_TEST_TIMEOUT_SCALE" in os.environ:
        return float(os.environ["ZEROTRAIN_TEST_TIMEOUT_SCALE"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(4.0, max(1.0, (os.getloadavg()[0] + 1) / cores + 0.5))


TIMEOUT_SCALE = _load_scale()
os.environ["ZEROTRAIN_TEST_TIMEOUT_SCALE"] = f"{TIMEOUT_SCALE:.2f}"  # seen by harness.run_ranks and children


def pytest_collection_modifyitems(config, items):
    """Scale every pytest-timeout limit (marker or ini) by the measured load."""
    if TIMEOUT_SCALE <= 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0]) if marker and marker.args else float(marker.kwargs.get("timeout", default)) if marker else default
        if limit > 0:
            item.add_marker(pytest.mark.timeout(limit * TIMEOUT_SCALE), append=False)


def pytest_report_header(config):
    return f"zerotrain: timeouts scaled x{TIMEOUT_SCALE:.2f} for the machine's load"


# ---------------------------------------------------------------------------- leaks
#: variables that are not a test's to leak: set by pytest per test, by this file at import, by
#: torch once per process (importing torch._dynamo, which the first optimizer does lazily, sets
#: the compiler's cache directories, torch/_inductor/runtime/cache_dir_utils.py), or by the peer
#: libraries the comparison tests import once per process (lightning_fabric sets
#: PYTORCH_NVML_BASED_CUDA_CHECK at import)
ENV_MANAGED = frozenset({"PYTEST_CURRENT_TEST", "ZEROTRAIN_TEST_TIMEOUT_SCALE",
                         "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"})
#: name prefixes of daemon threads a library keeps for the whole process; each with why
THREADS_ALLOWED: tuple[str, ...] = (
    # tqdm's monitor: torch.fx.Interpreter.run makes a (disabled) tqdm bar, and tqdm.__new__ starts
    # this one thread per process even for a disabled bar; torch.compile runs a traced
    # autograd.Function's backward through that interpreter (the DeepSpeed face's ZeRO-3 linear)
    "tqdm_monitor",
)
#: how long a thread that is finishing may take to end after its test
THREAD_GRACE_S = 2.0


def env_leaks(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Variables added, removed or changed between two snapshots of ``os.environ``."""
    out = []
    for key in sorted((before.keys() | after.keys()) - ENV_MANAGED):
        if key not in before:
            out.append(f"added {key}={after[key]!r}")
        elif key not in after:
            out.append(f"removed {key} (was {before[key]!r})")
        elif before[key] != after[key]:
            out.append(f"changed {key}: {before[key]!r} -> {after[key]!r}")
    return out


def restore_env(before: dict[str, str]) -> None:
    """Put ``os.environ`` back as it was (but for ENV_MANAGED), so one leak fails one test."""
    for key in set(os.environ) - set(before) - ENV_MANAGED:
        del os.environ[key]
    for key, value in before.items():
        if key not in ENV_MANAGED and os.environ.get(key) != value:
            os.environ[key] = value


def _alive(thread: threading.Thread) -> bool:
    if isinstance(thread, threading._DummyThread):
        # a thread started outside Python (gloo, a C++ pool) that once ran Python code: Python
        # 3.11 keeps it listed forever, so ask the kernel whether it still runs
        return os.path.isdir(f"/proc/self/task/{thread.native_id}")
    return thread.is_alive()


def thread_leaks(before: set[threading.Thread], grace_s: float = THREAD_GRACE_S) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive after up to ``grace_s`` seconds."""
    new = [t for t in threading.enumerate() if t not in before and not t.name.startswith(THREADS_ALLOWED)]
    deadline = time.monotonic() + grace_s
    for t in new:
        if not isinstance(t, threading._DummyThread):
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in new if _alive(t)]


def process_group_leaked() -> bool:
    """True when a default process group is still initialised; destroys it, so the next test
    starts without one."""
    dist = sys.modules.get("torch.distributed")  # never imported: nothing can be initialised
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True


@pytest.fixture(autouse=True)
def fail_on_leaks():
    """Fail (as an error at teardown) a test that leaves behind what the next test would see. The
    idea is Lightning Fabric's tests/conftest.py (restore_env_variables, teardown_process_group,
    thread_police_duuu_daaa_duuu_daaa). Use ``monkeypatch.setenv`` and join or stop threads."""
    env_before = dict(os.environ)
    threads_before = set(threading.enumerate())
    yield
    problems = []
    leaked_env = env_leaks(env_before, dict(os.environ))
    if leaked_env:
        restore_env(env_before)
        problems.append("environment variables leaked (use monkeypatch.setenv): " + "; ".join(leaked_env))
    threads = thread_leaks(threads_before)
    if threads:
        problems.append(f"threads still running {THREAD_GRACE_S:g}s after the test: "
                        + ", ".join(f"{t.name} (daemon={t.daemon})" for t in threads))
    if process_group_leaked():
        problems.append("the default process group was left initialised (destroyed now); "
                        "call torch.distributed.destroy_process_group() in the test")
    if problems:
        pytest.fail("leaked into later tests:\n  " + "\n  ".join(problems), pytrace=False)
