"""bench/moe_bench.py's harness, smoke-run on the tiny MoE GPT (timings are not checked: the
coordinator runs the real measurement on a quiet machine): the ep=2 case's all-to-alls reach the
ResourceMonitor's events and take a share of the step, the ep=1 case has none, and both train to
the same loss (same seed, same routing)."""
from __future__ import annotations

import argparse

import pytest

from zerotrain.bench import moe_bench

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_moe_bench_smoke(tmp_path):
    args = moe_bench.parse_args(["--model", "tiny", "--steps", "2", "--warmup", "1", "--repeats", "1",
                                 "--cases", "zero2_ep1,zero2_ep2", "--out", str(tmp_path / "r.md")])
    results = moe_bench.run_interleaved(args, args.cases.split(","), moe_bench.run_case)
    ep1, ep2 = results["zero2_ep1"][0], results["zero2_ep2"][0]
    assert ep1["a2a"] == 0 and 0 < ep2["a2a"] < ep2["step"]
    assert ep1["loss"] == pytest.approx(ep2["loss"], rel=1e-5)
    table = moe_bench.render(args, results)
    assert "| zero2_ep2 |" in table and "a2a share" in table
    assert isinstance(args, argparse.Namespace)
