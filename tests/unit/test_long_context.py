"""bench/long_context.py's search (issue 45: the longest trainable sequence with and without sp=2),
on simulated probes: a probe "fits" when a known memory curve stays within the cap, so the right
answer is known and the number of probes is counted. The real probes (torchrun jobs of the 118M
GPT) are the benchmark itself; the 2-process path on the tiny GPT is the slow test at the end.
"""
from __future__ import annotations

import pytest

from zerotrain.bench import long_context
from zerotrain.bench.long_context_search import (GiB, add_summary_row, next_length, render, search,
                                                 summary_row)

pytestmark = pytest.mark.timeout(60)

KiB = 1024
CAP, GRAIN, CALIB, MAX_LEN = 9 * GiB, 512, [1024, 2048], 131072


def _prober(peak_of, log: list):
    def probe(length: int) -> dict:
        log.append(length)
        peak = int(peak_of(length))
        return {"mode": "dp2", "length": length, "ok": peak <= CAP, "peak": min(peak, CAP + 1), "step_s": 1.0,
                "wall_s": 2.0, "why": None if peak <= CAP else "RSS > cap (killed)"}
    return probe


def _truth(peak_of) -> int:
    n = CALIB[-1]
    while peak_of(n + GRAIN) <= CAP:
        n += GRAIN
    return n


@pytest.mark.parametrize("peak_of, most_probes", [
    # a straight line: doubling to 8192 (never more than twice what fits), then the line's answer and one more
    (lambda n: 2.5 * GiB + 700 * KiB * n, 4),
    (lambda n: 2.5 * GiB + 350 * KiB * n, 5),  # sp=2's half slope: one doubling more
    (lambda n: 2.5 * GiB + 600 * KiB * n + 4 * n * n, 4),  # a quadratic term (attention scores): ~10% at 9k
    (lambda n: 2.5 * GiB + 300 * KiB * n + 30 * n * n, 5),  # strongly superlinear: the line overshoots by 60%
    # short lengths peak at the optimizer step (a floor), as the 118M GPT does below ~3k tokens: the
    # calibration's line is flat and predicts no limit; doubling finds the slope
    (lambda n: max(5 * GiB, 2.5 * GiB + 700 * KiB * n), 4),
], ids=["linear", "half-slope", "mildly-quadratic", "quadratic", "optimizer-floor"])
def test_search_finds_the_longest_fitting_length_in_few_probes(peak_of, most_probes):
    log: list = []
    row = search("dp2", _prober(peak_of, log), CALIB, CAP, GRAIN, MAX_LEN, max_probes=6)
    truth = _truth(peak_of)
    assert row["best"]["length"] == truth and row["first_fail"] == truth + GRAIN
    assert log[:2] == CALIB and len(log) - 2 <= most_probes, log
    assert all(n % GRAIN == 0 for n in log)


def test_linear_model_predicts_the_answer_from_the_calibration():
    row = search("sp2", _prober(lambda n: 2.5 * GiB + 350 * KiB * n, []), CALIB, CAP, GRAIN, MAX_LEN, max_probes=0)
    assert row["predicted"] == _truth(lambda n: 2.5 * GiB + 350 * KiB * n)
    assert row["slope"] == pytest.approx(350 * KiB) and row["best"]["length"] == 2048  # no probe beyond calibration


def test_search_stops_at_max_len_and_when_calibration_does_not_fit():
    log: list = []
    row = search("dp2", _prober(lambda n: GiB + n, log), CALIB, CAP, GRAIN, 4096, max_probes=4)
    assert row["best"]["length"] == 4096 and row["first_fail"] is None and log == [1024, 2048, 4096]
    row = search("dp2", _prober(lambda n: 10 * GiB + n, []), CALIB, CAP, GRAIN, MAX_LEN, max_probes=4)
    assert row["best"] is None and row["predicted"] is None and len(row["probes"]) == 2
    assert "| dp=2 (no sp) | none | 1024 |" in render([row], CAP)


def test_search_starts_no_probe_once_the_budget_is_spent():
    log: list = []  # every probe takes 2 s: after the calibration's 4 s, one more within a 5 s budget
    row = search("dp2", _prober(lambda n: 2.5 * GiB + 700 * KiB * n, log), CALIB, CAP, GRAIN, MAX_LEN, 4, budget_s=5)
    assert log == [1024, 2048, 4096] and row["stopped"] and row["first_fail"] is None
    assert "| 3 (time budget spent) |" in render([row], CAP)


def test_next_length_keeps_to_the_middle_of_the_bracket():
    passed = {1024: 3 * GiB, 2048: 3 * GiB + 1}  # a line that predicts far beyond everything
    assert next_length(passed, set(), CAP, GRAIN, MAX_LEN) == 4096  # no failure yet: at most double
    assert next_length(passed, {8192}, CAP, GRAIN, MAX_LEN) == 6656  # 8192 - 6144 / 4, a multiple of 512
    assert next_length(passed, {2560}, CAP, GRAIN, MAX_LEN) is None  # 2048 fits, 2560 does not: done
    flat = {1024: 3 * GiB, 2048: 8 * GiB}  # a line that predicts less than what already fits
    assert next_length(flat, {8192}, CAP, GRAIN, MAX_LEN) == 3584  # at least a quarter into the bracket


def test_results_rows_and_summary_table():
    rows = [search(m, _prober(lambda n, s=s: 2.5 * GiB + 700 * KiB * n / s, []), CALIB, CAP, GRAIN, MAX_LEN, 6)
            for m, s in (("dp2", 1), ("sp2", 2))]
    table = render(rows, CAP)
    assert "| dp=2 (no sp) | 9728 | 10240 | " in table and "| dp=1 x sp=2 (Ulysses) | 19456 | 19968 |" in table
    row = summary_row(rows, "Longest trainable sequence (x)", "2026-12-06 21:00, abc, CPU", "Section")
    assert row.startswith("| Longest trainable sequence (x) | dp2: 9728 tokens (first failing 10240); sp2: 19456")
    text = "# R\n\n| what | figure |\n|---|---|\n| a | 1 |\n\n## next\n| other | table |\n"
    once = add_summary_row(text, row)
    assert once.split("\n")[5] == row and once.count(row) == 1 and once.endswith("| other | table |\n")
    assert add_summary_row(once, row.replace("9728", "9216")).count("9216 tokens") == 1  # a rerun replaces its row


@pytest.mark.parametrize("argv, message", [
    (["--modes", "dp2,tp2"], "--modes"), (["--cap-gib", "30"], "--cap-gib=30.0: valid: 0 < cap <= 10"),
    (["--calib", "1000,2048"], "--calib=[1000, 2048]: valid: two different positive multiples of --grain=512"),
    (["--grain", "3"], "--grain=3"), (["--model", "nope"], "--model='nope'"),
])
def test_bad_options_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        long_context.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dry_run_on_two_processes(tmp_path, capsys):
    """The tiny GPT through the real path: torchrun, the Trainer with DDP(sequence_parallel=1 / 2),
    the RSS watch, the tables appended to a copy of the summary."""
    out = tmp_path / "RESULTS.md"
    out.write_text("# R\n\n| what | figure |\n|---|---|\n| a | 1 |\n")
    long_context.main(["--dry-run", "--precision", "32", "--out", str(out), "--workdir", str(tmp_path / "w")])
    text = out.read_text()
    assert "| dp=2 (no sp) | 1024 | - |" in text and "| dp=1 x sp=2 (Ulysses) | 1024 | - |" in text, text
    assert "| Longest trainable sequence (tiny)" in text.split("\n")[5]
