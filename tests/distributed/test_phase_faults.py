"""bench/phase_faults.py on 2 real gloo processes: the table has a row per phase of the step, and
its 'step' row is the sum of the phases (the diagnostic's own arithmetic), with the forward and
backward carrying the time; and that the strategy's host cache served blocks in the timed steps.
No assertion on speed or on a fault count."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_phase_table_adds_up(tmp_path):
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zerotrain.bench.phase_faults", "--strategy", "zero3", "--model", "tiny_untied",
           "--steps", "2", "--warmup", "1", "--options", '{"max_reuse_distance": 0, "host_cache_min_bytes": 4096}']
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=180 * scale)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "zero3 {'max_reuse_distance': 0, 'host_cache_min_bytes': 4096}, 2 ranks" in proc.stdout
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "phase":
            rows[cells[0]] = [float(c) for c in cells[1:]]
    assert {"forward -> forward end", "backward -> backward end", "step"} <= set(rows)
    parts = [v for k, v in rows.items() if k != "step"]
    for i in range(4):  # each printed to 0.1: the sum within rounding
        assert abs(sum(p[i] for p in parts) - rows["step"][i]) <= 0.05 * len(parts) + 1e-9
    assert rows["forward -> forward end"][2] > 0 and rows["backward -> backward end"][2] > 0
    # the strategy put the host cache in front of torch's allocator, and the timed steps reuse it
    cache = next(line for line in proc.stdout.splitlines() if line.startswith("host cache per step: "))
    assert float(cache.split(": ")[1].split(" hits")[0]) > 0, cache
    assert " MiB mapped afresh; " in cache, cache


def test_asking_torch_for_huge_pages_keeps_torchs_allocator(tmp_path):
    """THP_MEM_ALLOC_ENABLE=1 is torch's allocator's setting; the host cache would replace that
    allocator and drop it, so ``host_cache.enable`` declines and the strategy's ranks keep torch's."""
    from zerotrain.ops import builder

    if builder.host_cache_module() is None:  # then the cache is off anyway: nothing to tell apart
        pytest.skip("the host cache op is not built here")
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zerotrain.bench.phase_faults", "--strategy", "zero2", "--model", "tiny_untied",
           "--steps", "1", "--warmup", "1", "--options", '{"host_cache_min_bytes": 4096}']
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "THP_MEM_ALLOC_ENABLE": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180 * scale)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "host cache: not installed" in proc.stdout
    assert "host cache per step" not in proc.stdout
