"""``bench/gpu_check.sh --dry-run``: the prepared GPU check stays runnable on a machine without a GPU
(it lists its steps, checks that every file and tool it needs is here and that the steps' timeouts
fit its 8 minutes); a bad argument is refused."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def run(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.timeout(180)
def test_dry_run_lists_the_steps_and_finds_everything():
    proc = run("--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line.split("]")[0].removeprefix("would run [") for line in proc.stdout.splitlines()
             if line.startswith("would run [")]
    assert steps == ["env", "nccl", "kernels", "cuda_tests", "gpt124m", "offload_ladder"]
    total = int(proc.stdout.split("total of the step timeouts: ")[1].split(" s")[0])
    assert total <= 480
    assert "dry run ok" in proc.stdout


@pytest.mark.timeout(180)
def test_dry_run_names_what_is_missing(tmp_path):
    """A copy of the repository without one kernel source: the dry run fails and names it."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.so", "zerotrain.egg-info"),
                    symlinks=True)
    (copy / "csrc" / "quantize" / "quantize.cu").unlink()
    proc = run("--dry-run", root=copy)
    assert proc.returncode == 1
    assert "missing: csrc/quantize/quantize.cu" in proc.stderr


def test_unknown_argument_is_refused():
    proc = run("--dryrun")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_check.sh: unknown argument '--dryrun'; valid: --dry-run, --out DIR"
