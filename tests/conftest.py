"""Shared test set-up: tests/ and tests/distributed/ are importable by plain module name, so that
worker functions for multi-process tests can be found again in the child processes."""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("", "distributed"):
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
