"""The ZeRO memory formulas, the zerotrain-estimate command and storage counting."""
import pytest
import torch

from zerotrain.strategies.memory import count_bytes, storage_bytes
from zerotrain.strategies.zero.estimate import (
    estimate_model_states, format_bytes, gpt_num_params, main)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_mixed_precision_adam_formulas(world):
    psi = 1_000_000 * world  # divisible, so the formulas are exact
    est = estimate_model_states(psi, world, "bf16-mixed")
    assert est["ddp"].total == 16 * psi
    assert est["zero1"].total == 2 * psi + 2 * psi + 12 * psi // world
    assert est["zero2"].total == 2 * psi + 14 * psi // world
    assert est["zero3"].total == 16 * psi // world
    z1 = est["zero1"]
    assert (z1.params, z1.grads, z1.master, z1.optimizer) == (2 * psi, 2 * psi, 4 * psi // world, 8 * psi // world)


def test_fp32_has_no_separate_master_and_overrides_apply():
    est = estimate_model_states(100, 4, "32")
    assert est["zero1"].master == 0 and est["zero1"].total == 4 * 100 + 4 * 100 + 8 * 25
    sgd = estimate_model_states(100, 4, "bf16-mixed", optimizer_bytes=4, grad_bytes=4)
    assert sgd["zero2"].optimizer == 4 * 25 and sgd["zero2"].grads == 4 * 25
    assert estimate_model_states(10, 3)["zero3"].params == 2 * 4  # ceil(10 / 3) per rank


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size=0"):
        estimate_model_states(10, 0)
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate_model_states(10, 2, "fp8")
    with pytest.raises(ValueError, match="num_params=-1"):
        estimate_model_states(-1, 2)


def test_gpt_param_count():
    assert gpt_num_params(12, 768, 50257) == 124_439_808  # GPT-2 small (tied head)
    assert gpt_num_params(1, 4, 10, block_size=8, bias=False, tied_embeddings=False) == (
        10 * 4 + 8 * 4 + (12 * 16 + 2 * 4) + 4 + 10 * 4)


def test_command_prints_every_stage(capsys):
    assert main(["--n-layer", "12", "--n-embd", "768", "--world-size", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808 parameters" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["4"])]
    assert [r[1] for r in rows] == ["ddp", "zero1", "zero2", "zero3"] * 2
    assert main(["--num-params", "1e6"]) == 0
    assert "1,000,000 parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--num-params", "1e6", "--n-layer", "2", "--n-embd", "8"])
    with pytest.raises(SystemExit):
        main(["--num-params", "10", "--world-size", "0"])


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.00 GiB"


def test_count_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:10], flat[10:60], flat[60:]]
    other = torch.zeros(7, dtype=torch.bfloat16)
    assert storage_bytes(views + [other]) == 400 + 14

    class Fake:
        def memory_tensors(self):
            # the master is a view of the params: charged to params only
            return {"params": views, "grads": [other], "master": [flat[20:30]], "optimizer": []}

    got = count_bytes(Fake())
    assert got == {"params": 400, "grads": 14, "master": 0, "optimizer": 0, "comm_buffers": 0, "total": 414}
