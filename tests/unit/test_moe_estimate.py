"""``zerotrain-estimate --expert-params E --ep-size n`` (strategies/moe/estimate.py): a rank's
experts are a model of E/n parameters replicated over its n-strided expert-data-parallel group,
the dense ones a model replicated over the world; bad input: one line, rc 2."""
from __future__ import annotations

import pytest

from zerotrain.strategies.moe.estimate import estimate_with_experts
from zerotrain.strategies.zero.estimate import main

pytestmark = pytest.mark.timeout(60)


def test_the_split_per_stage():
    est = estimate_with_experts(200_000, 800_000, 4, 2, "32", optimizer_bytes=8)
    assert est["ddp"].params == 4 * (200_000 + 400_000)  # experts: half on a rank, whole
    assert est["zero1"].optimizer == 8 * (200_000 + 800_000) // 4  # every state element once over the world
    assert est["zero2"].grads == 4 * (200_000 + 800_000) // 4 and est["zero2"].params == est["ddp"].params
    assert est["zero3"].total == 16 * 1_000_000 // 4
    assert estimate_with_experts(1000, 0, 4, 1, "32")["zero3"].params == 4 * 250


def test_the_command(capsys):
    assert main(["--num-params", "1e6", "--expert-params", "8e5", "--ep-size", "2", "--world-size", "4",
                 "--precision", "32"]) == 0
    out = capsys.readouterr().out
    assert "(200,000 dense, 800,000 in experts over ep_size=2)" in out
    assert "     4  zero3   976.56 KiB   976.56 KiB          0 B     1.91 MiB     3.81 MiB" in out


@pytest.mark.parametrize("argv, message", [
    (["--expert-params", "2e6"], "--expert-params=2e+06: expected a count in [0, the parameters 1000000]"),
    (["--expert-params", "8e5", "--ep-size", "3", "--world-size", "2"], "ep_size=3; valid: a divisor of the world"),
    (["--expert-params", "8e5", "--offload-stage", "3"], "without offload options"),
])
def test_bad_input_is_one_line_rc_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--num-params", "1e6", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
