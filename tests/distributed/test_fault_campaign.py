"""A dozen jobs of the fault-injection campaign (``bench/fault_campaign.py``): every fault kind
at least once (the first ten jobs of a draw are one of each), on real 2-3 process jobs under our
launcher and torchrun. Each must end within 30 s of its fault, name the right rank (or file) and
cause, leave no process behind, and resume from ``latest`` to the parameters of a run that never
failed, bit for bit."""
from __future__ import annotations

import json

import pytest

from zerotrain.bench import fault_campaign


def test_a_draw_covers_every_fault_and_strategy():
    jobs = fault_campaign.draw(12, seed=1)
    assert {j["fault"] for j in jobs[:len(fault_campaign.FAULTS)]} == set(fault_campaign.FAULTS)
    assert {j["strategy"] for j in jobs[:len(fault_campaign.STRATEGIES)]} == set(fault_campaign.STRATEGIES)
    assert all(0 <= j["rank"] < j["world"] and 2 <= j["step"] < fault_campaign.STEPS - 2 for j in jobs)
    assert jobs == fault_campaign.draw(12, seed=1)  # seeded


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_dozen_faults_end_quickly_named_without_orphans_and_resume_exactly(tmp_path):
    out = tmp_path / "rows.json"
    code = fault_campaign.main(["--jobs", "12", "--seed", "1", "--workdir", str(tmp_path / "jobs"),
                                "--out", str(out), "--markdown", str(tmp_path / "table.md")])
    rows = json.loads(out.read_text())
    assert len(rows) == 12
    for r in rows:
        what = f"job {r['id']} ({r['strategy']}, {r['launcher']}, world {r['world']}, {r['fault']} on rank " \
               f"{r['rank']} at step {r['step']}): {r['note']}"
        assert r["ended_s"] is not None and r["ended_s"] <= fault_campaign.END_WITHIN_S, what
        assert r["named"] and r["cause"], what
        assert not r["orphans"], what
        assert r["exact"], what
    assert code == 0
