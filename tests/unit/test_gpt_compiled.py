"""bench/gpt_compiled.py: every ``<system>_c`` reaches its compiled runner (``fsdp2_c`` and
``ds_zeroK_c`` were taken by the eager systems' prefix rules first), and the MFU table's figures."""
from __future__ import annotations

import argparse
import functools

import pytest


@pytest.mark.parametrize("system", ["ddp_c", "fsdp2_c", "fsdp2_zero2_c", "ds_zero1_c", "ds_zero3_c", "zt_zero3_c"])
def test_each_compiled_system_runs_its_compiled_runner(system):
    from zerotrain.bench import gpt_bench, gpt_compiled
    runner = gpt_bench._worker_runner(system)
    fn = runner.func if isinstance(runner, functools.partial) else runner
    assert fn.__module__ == gpt_compiled.__name__, (system, fn)
    if system.startswith("fsdp2"):
        assert runner.keywords == {"reshard_after_forward": system == "fsdp2_c"}


def test_mfu_table(monkeypatch):
    from zerotrain.bench import gpt_compiled
    from zerotrain.bench.common import MODELS
    from zerotrain.bench.gpt_report import RunSummary
    monkeypatch.setattr(gpt_compiled, "matmul_peak", lambda dtype: 1e12)
    spec = MODELS["tiny"]
    flops = gpt_compiled.step_flops(spec, 2)
    run = RunSummary(step_s=flops / 0.5e12, rss_peak=int(1.5e9), rss_delta=0, losses=[1.0], faults=0, optimizer="x",
                     threads=1, first_step_s=flops / 0.5e12 + 7.0)
    args = argparse.Namespace(precision="32", nproc=2, threads=1)
    table = gpt_compiled.render_mfu(args, {"ddp": [run], "zt_zero2_c": [run]}, spec)
    assert "2.000 TFLOP/s" in table  # 1e12 per thread x 2 ranks x 1 thread
    assert f"| zt_zero2_c | {run.step_s:.4f} | 1.00 | 0.500 | 25.0% | 7.0 | 1.50 |" in table
