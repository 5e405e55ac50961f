"""``strategy.tensor_parallel`` on the command line (issue 45): ``zerotrain-train strategy=ddp
strategy.tensor_parallel=2 trainer.devices=2`` trains the demo GPT cut by ``GPT.tp_plan`` over both
ranks (one data-parallel replica reading the whole batch of 8 sequences), its loss the
vocabulary-parallel cross-entropy (``GPTModule.logits_loss``), clipped at 1.0 by the whole model's
norm; every logged loss equals the plain single-process loop's (test_pipeline_cli's reference: the
same seed, data, AdamW, schedule and clipping). The sample at the end is drawn from the shards
gathered whole on rank 0. Checkpoints are off (this test is about the key).

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop) on each logged loss.
"""
from __future__ import annotations

import pytest

from test_pipeline_cli import STEPS, _cli, _logged_losses, _reference, _root

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_tp2_from_the_cli_matches_the_plain_loop(tmp_path_factory):
    run_dir = _cli(_root(tmp_path_factory), "ddp_tp2", 2, 1, "strategy=ddp", "strategy.tensor_parallel=2",
                   "trainer.enable_checkpointing=false", "sample_tokens=8")
    got = _logged_losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    ref = _reference()["losses"][1]
    assert [got[s] for s in range(1, STEPS + 1)] == pytest.approx(ref, rel=1e-5)
    stdout = (run_dir / "stdout.txt").read_text()
    assert stdout.count("----- sample -----") == 1 and "done: 4 steps" in stdout, stdout[-2000:]
    # each rank holds half of every cut layer (wte/lm_head, c_attn, c_proj, c_fc: 114,688 of the
    # GPT's 119,104 parameters) and the rest whole: 61,760
    assert "61.8 K trainable params" in stdout, stdout[:2000]
