"""ZeRO-3 over a tensor axis writes and reads the one reshardable format (issue 45): its adapter is
``TensorAxis(Stage3Checkpoint)`` (parallel/tensor_checkpoint.py), each tensor-parallel parameter saved
whole from the units' fp32 masters and loaded cut. tp=2 under ZeRO-3 on 2 ranks saves at step 2; plain
ZeRO-3 (tp=1) on the same 2 ranks and tp=2 under ZeRO-3 again resume it: the next steps' losses and the
final parameters equal the uninterrupted run's.

# tolerance: rel <= 1e-5 (test_tensor_parallel_checkpoint's bound: issue 45's for fp32).
"""
from __future__ import annotations

import pytest

from test_tensor_parallel_checkpoint import SAVE_AT, _assert_continues, _spawn

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_tp2_under_zero3_resumes_as_zero3_with_tp1_and_tp2(tmp_path_factory):
    ckpt = f"z3tp/step={SAVE_AT:06d}.ckpt"
    ranks = _spawn(tmp_path_factory, 2, dict(strategy="zero3", devices=2, tensor_parallel=2, save="z3tp"),
                   dict(strategy="zero3", devices=2, resume=ckpt),
                   dict(strategy="zero3", devices=2, tensor_parallel=2, resume=ckpt))
    assert [r[0]["tp"] for r in ranks] == [2, 2] and [r[1]["tp"] for r in ranks] == [1, 1]
    _assert_continues(ranks, 1, ranks, 0)
    _assert_continues(ranks, 2, ranks, 0)
