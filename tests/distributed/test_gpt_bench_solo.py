"""bench/gpt_bench.py's ``solo`` floor on 2 real gloo processes beside DDP: each rank steps a model
of its own (same weights, its own micro-batch), so its first loss is DDP's and its later ones are
not (DDP averages the two ranks' gradients, solo does not: no communication in its steps)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_worker(tmp_path, system: str) -> list[list[float]]:
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    out = tmp_path / system
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "zerotrain.bench.gpt_bench", "--worker", system, "--model", "tiny", "--precision", "32",
           "--data", "stdlib", "--steps", "2", "--warmup", "1", "--seed", "0", "--result-dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=120 * scale)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text())["losses"] for r in range(2)]


@pytest.mark.slow  # moved out of the default suite for its 15-minute budget
def test_solo_starts_as_ddp_and_steps_on_its_own_gradient(tmp_path):
    ddp, solo = run_worker(tmp_path, "ddp"), run_worker(tmp_path, "solo")
    for r in range(2):
        assert solo[r][0] == ddp[r][0]  # the same weights and micro-batch
        assert all(abs(a - b) > 1e-6 for a, b in zip(solo[r][1:], ddp[r][1:]))  # its own update
    assert len(solo[0]) == 3
