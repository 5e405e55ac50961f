"""Precision plugins without processes: the loss scaler's exact rules and the null defaults."""
import pytest
import torch

from zerotrain.strategies.precision import (BF16Mixed, DynamicLossScaler, FP16Mixed, LossScaleError,
                                            Precision, precision_from_name)


def test_scale_sequence_with_hysteresis_and_growth():
    s = DynamicLossScaler(init_scale=1024, growth_interval=3, hysteresis=2, min_scale=1)
    seq = []
    for overflow in [False, True, True, False, False, False, True, False, True, True]:
        s.update(overflow)
        seq.append(s.scale)
    # 1st overflow spends hysteresis, 2nd halves; 3 good steps grow and refill hysteresis
    # hysteresis is refilled only by growth (DeepSpeed's default), so the last two overflows halve twice
    assert seq == [1024, 1024, 512, 512, 512, 1024, 1024, 1024, 512, 256]


def test_min_scale_raises_instead_of_looping():
    s = DynamicLossScaler(init_scale=2, hysteresis=1, min_scale=1)
    s.update(True)
    assert s.scale == 1
    with pytest.raises(LossScaleError, match="minimum loss scale 1"):
        s.update(True)


def test_scaler_validates_its_fields():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_unscale_detects_inf_and_calls_the_collective_once():
    p = FP16Mixed(DynamicLossScaler(init_scale=4))
    calls = []

    def any_rank(flag):
        calls.append(flag)
        return flag

    g = [torch.full((3,), 8.0), torch.tensor([1.0, float("inf")])]
    assert p.unscale_and_check(g, any_rank) is True
    assert calls == [True]
    assert torch.equal(g[0], torch.full((3,), 2.0))
    assert p.unscale_and_check([torch.ones(2)], any_rank) is False


def test_null_plugins_do_nothing():
    for plugin in (Precision(), BF16Mixed()):
        loss = torch.tensor(3.0)
        assert plugin.scale_loss(loss) is loss
        assert plugin.unscale_and_check([torch.tensor([float("inf")])], lambda f: 1 / 0) is False


def test_precision_names():
    assert precision_from_name("bf16-mixed").name == "bf16-mixed"
    with pytest.raises(ValueError, match="precision='fp8'.*valid choices: 32, bf16-mixed"):
        precision_from_name("fp8")
