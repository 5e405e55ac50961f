"""The harness itself: a raising rank and a hung rank each fail the test in seconds."""
import time

import pytest
import torch
import torch.distributed as dist

from harness import RankFailed, init_dist, run_ranks


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


def test_all_reduce_runs_on_real_processes(tmp_path):
    out = run_ranks("test_harness:_sum_ranks", 3, tmp_path, timeout=60)
    assert [o["sum"].item() for o in out] == [6.0, 6.0, 6.0]


def test_raising_rank_fails_fast_with_traceback(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="boom from rank 1"):
        run_ranks("test_harness:_raise_on_rank_1", 2, tmp_path, timeout=60)
    assert time.monotonic() - t0 < 30


def test_hung_rank_fails_within_its_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="_hang_on_rank_0"):
        run_ranks("test_harness:_hang_on_rank_0", 2, tmp_path, timeout=8)
    assert time.monotonic() - t0 < 40
