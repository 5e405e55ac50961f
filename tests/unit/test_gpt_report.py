"""gpt_bench's report: a run's summary from its ranks' records, and the ratios per repeat."""
import argparse
import math

import pytest

pytestmark = pytest.mark.timeout(60)


def record(times, cpu=None, faults=None):
    n = len(times)
    return {"step_times": times, "losses": [1.0] * n, "rss_peak": 2 << 30, "rss_base": 1 << 30,
            "optimizer": "fused", "threads": 1, "step_faults": faults or [0] * n,
            **({"step_cpu": cpu} if cpu is not None else {})}


def test_summary_sums_cpu_over_ranks_and_keeps_the_slowest_rank():
    from zerotrain.bench.gpt_report import summarise_run

    # warm-up step 0 dropped; per step: rank CPU summed (3.0, 5.0, 4.0) -> median 4.0
    r0 = record([9.0, 1.0, 1.2, 1.1], cpu=[9.0, 1.0, 2.0, 1.5], faults=[99, 10, 30, 20])
    r1 = record([9.0, 1.3, 1.4, 1.5], cpu=[9.0, 2.0, 3.0, 2.5], faults=[99, 40, 5, 5])
    s = summarise_run([r0, r1], warmup=1)
    assert s.step_s == pytest.approx(1.4)  # rank 1's median
    assert s.cpu_s == pytest.approx(4.0)
    assert s.faults == 30  # max over ranks per step (40, 30, 20): median 30
    # records from before the CPU column: NaN, not an error
    assert math.isnan(summarise_run([record([1.0, 1.0]), record([1.0, 1.0])], warmup=1).cpu_s)


def run(step, losses=(2.0, 1.0)):
    """One repeat's summary: ``step`` seconds, ``losses`` per step."""
    from zerotrain.bench.gpt_report import RunSummary

    return RunSummary(step_s=step, rss_peak=1 << 30, rss_delta=0, losses=list(losses), faults=0.0,
                      optimizer="fused", threads=1, cpu_s=2 * step)


ARGS = argparse.Namespace(model="tiny", nproc=2, threads=1)


def test_each_repeat_is_divided_by_the_baseline_of_the_same_repeat():
    from zerotrain.bench.gpt_report import render, round_ratios

    # the machine slows down 2x in repeat 1: the median of the ratios sees through it, the
    # ratio of the medians (1.5 / 1.5 = 1.0) does not
    results = {"ddp": [run(1.0), run(2.0)], "zt_zero2": [run(0.9), run(1.8)], "zt_zero3": [run(1.1)]}
    ratios = round_ratios(results, "ddp")
    assert ratios["zt_zero2"] == pytest.approx([0.9, 0.9])
    assert ratios["zt_zero3"] == pytest.approx([1.1])  # one completed repeat: one ratio
    text = render(ARGS, results, {}, {})
    assert "| zt_zero2 | 0.90 | 0.90 | 0.90 |" in text
    assert "| zt_zero3 | 1.10 | - | 1.10 |" in text
    assert "| ddp's step (s) | 1.000 | 2.000 | |" in text
    assert "| zt_zero2 | 1.3500 | 0.90 |" in text  # the main table: median step 1.35, CPU column next


def test_the_solo_floor_gets_a_table_of_ratios_of_its_own():
    from zerotrain.bench.gpt_report import render

    results = {"ddp": [run(1.0), run(2.0)], "solo+heap": [run(0.8), run(1.6)], "zt_zero3": [run(0.88), run(1.6)]}
    text = render(ARGS, results, {}, {})
    assert "| solo+heap's step (s) | 0.800 | 1.600 | |" in text
    assert "| zt_zero3 | 1.10 | 1.00 | 1.05 |" in text  # per repeat: 0.88 / 0.8, 1.6 / 1.6
    assert "| ddp | 1.25 | 1.25 | 1.25 |" in text
    assert "| zt_zero3 | 0.88 | 0.80 | 0.84 |" in text  # the table against ddp is still there
    # the loss table's last column compares the training systems only, not the floor
    results["solo+heap"] = [run(0.8, losses=(2.0, 1.5))] * 2
    text = render(ARGS, results, {}, {})
    assert "| 1 | 1.000000 | 1.500000 | 1.000000 | 0.00e+00 |" in text
    # without a solo run, one table of ratios
    del results["solo+heap"]
    assert "step (s) |" in render(ARGS, results, {}, {})
    assert "solo" not in render(ARGS, results, {}, {})


def test_an_environment_suffix_sets_the_ranks_environment(monkeypatch):
    from zerotrain.bench import gpt_bench

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # the driver's shell does not leak into a run
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    args = gpt_bench.parse_args(["--systems", "ddp+thp,zt_zero1+nothp,zt_zero2,zt_zero3+heap"])
    assert gpt_bench.base_system("zt_pipe_m4+thp") == "zt_pipe_m4"
    assert gpt_bench.base_system("zt_zero3_qwqg") == "zt_zero3_qwqg"
    assert gpt_bench.child_env(args, "ddp+thp")["THP_MEM_ALLOC_ENABLE"] == "1"
    assert gpt_bench.base_system("zt_zero3+heap") == "zt_zero3"
    assert "mmap_max=0" in gpt_bench.child_env(args, "zt_zero3+heap")["GLIBC_TUNABLES"]
    assert gpt_bench.child_env(args, "zt_zero1+nothp")["THP_MEM_ALLOC_ENABLE"] == "0"
    assert "THP_MEM_ALLOC_ENABLE" not in gpt_bench.child_env(args, "zt_zero2")
    assert "GLIBC_TUNABLES" not in gpt_bench.child_env(args, "zt_zero2")
