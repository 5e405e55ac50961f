"""The harness itself: a raising rank and a hung rank each fail the test in seconds, a rank forked
from the zygote is a process of its own, and conftest's ``fail_on_leaks`` fails a test that leaks a
variable, a thread or a process group."""
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import RankFailed, init_dist, run_ranks

pytest_plugins = ["pytester"]


def _sum_ranks():
    rank, _ = init_dist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"sum": t}


def _raise_on_rank_1():
    rank, _ = init_dist()
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()


def _hang_on_rank_0():
    rank, _ = init_dist(timeout_s=300)
    if rank == 0:
        time.sleep(600)
    dist.barrier()


def _who_am_i(code: int = 0):
    import random
    import sys

    if code:
        sys.exit(code)
    return {"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv, "rank": os.environ["RANK"],
            "draw": random.random(), "tensor": torch.rand(1)}


def test_a_forked_rank_is_a_process_of_its_own(tmp_path):
    """Ranks forked from the zygote (the default) start as a fresh one would: their own session,
    the spawn's directory, argv and environment, their own random seeds; a fresh spawn matches."""
    forked = run_ranks("test_harness:_who_am_i", 2, tmp_path / "f", timeout=60)
    fresh = run_ranks("test_harness:_who_am_i", 2, tmp_path / "n", timeout=60, fresh=True)
    for runs, where in ((forked, tmp_path / "f"), (fresh, tmp_path / "n")):
        assert [r["rank"] for r in runs] == ["0", "1"]
        for r in runs:
            assert r["sid"] == r["pid"] and r["cwd"] == str(where)
            assert r["argv"][0].endswith("harness.py") and r["argv"][1] == "test_harness:_who_am_i"
    for key in ("draw", "tensor"):  # Python's and torch's generators: seeded anew in each process
        draws = {float(r[key]) for r in forked + fresh}
        assert len(draws) == 4, f"forked ranks share the zygote's {key} state"
    with pytest.raises(RankFailed, match="exited with code 3"):
        run_ranks("test_harness:_who_am_i", 2, tmp_path / "x", timeout=60, code=3)


def test_needs_fresh_only_for_variables_read_at_start_up():
    from harness import needs_fresh

    base = {"HOME": "/h", "PATH": "/bin"}
    assert not needs_fresh(dict(base, RANK="1", MASTER_PORT="5", ZT_TEST_RESULT="r", PYTHONPATH="x"), base)
    assert needs_fresh(dict(base, MALLOC_MMAP_THRESHOLD_="131072"), base)
    assert needs_fresh({"HOME": "/h"}, base)  # removed
    assert needs_fresh(dict(base, HOME="/other"), base)


@pytest.mark.slow
def test_all_reduce_runs_on_real_processes(tmp_path):
    out = run_ranks("test_harness:_sum_ranks", 3, tmp_path, timeout=60)
    assert [o["sum"].item() for o in out] == [6.0, 6.0, 6.0]


def test_raising_rank_fails_fast_with_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="boom from rank 1"):
        run_ranks("test_harness:_raise_on_rank_1", 2, tmp_path, timeout=60)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # ~13 s; the progress-watchdog tests (test_failures.py) end hung ranks by default
def test_hung_rank_fails_within_its_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="_hang_on_rank_0"):
        run_ranks("test_harness:_hang_on_rank_0", 2, tmp_path, timeout=8)
    assert time.monotonic() - t0 < 40


def _join_twice():
    """Destroy and join again: the second join meets in a new file, not among the old keys."""
    init_dist()
    dist.destroy_process_group()
    rank, world = init_dist()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return {"sum": t, "store": type(store).__name__}


def test_ranks_meet_through_a_file_and_can_join_again(tmp_path):
    out = run_ranks("test_harness:_join_twice", 2, tmp_path, timeout=60)
    assert [o["sum"].item() for o in out] == [3.0, 3.0]
    assert [o["store"] for o in out] == ["FileStore", "FileStore"]  # no port was bound


LEAKY_TESTS = """
import os
import threading
import time

import torch.distributed as dist


def test_adds_a_variable():
    os.environ["ZT_SYNTHETIC_LEAK"] = "1"


def test_removes_a_variable():
    del os.environ["ZT_SYNTHETIC_PRESET"]


def test_changes_a_variable():
    os.environ["ZT_SYNTHETIC_PRESET"] = "changed"


def test_leaves_a_thread_running():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="zt-synthetic-leak", daemon=True)
    thread.stop = stop  # for the outer test to end it
    thread.start()


def test_leaves_the_process_group_initialised(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)


def test_cleaning_up_is_not_a_leak(monkeypatch, tmp_path):
    monkeypatch.setenv("ZT_SYNTHETIC_LEAK", "1")
    threading.Thread(target=time.sleep, args=(0.2,), name="zt-finishing").start()  # ends in the grace
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    dist.destroy_process_group()
"""


def test_leak_fixture_fails_each_kind_of_leak(pytester, monkeypatch):
    monkeypatch.setenv("ZT_SYNTHETIC_PRESET", "preset")
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(test_leaky=LEAKY_TESTS)
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    finally:
        for thread in threading.enumerate():
            if thread.name == "zt-synthetic-leak":
                thread.stop.set()
                thread.join()
    result.assert_outcomes(passed=6, errors=5)  # each leak errors at its test's teardown
    result.stdout.fnmatch_lines_random([
        "*ERROR at teardown of test_adds_a_variable*",
        "*added ZT_SYNTHETIC_LEAK='1'*",
        "*removed ZT_SYNTHETIC_PRESET (was 'preset')*",
        "*changed ZT_SYNTHETIC_PRESET: 'preset' -> 'changed'*",
        "*threads still running*zt-synthetic-leak (daemon=True)*",
        "*default process group was left initialised*",
    ])
    # and each was undone, so the leak stayed in the test that made it
    assert "ZT_SYNTHETIC_LEAK" not in os.environ
    assert not dist.is_initialized()
