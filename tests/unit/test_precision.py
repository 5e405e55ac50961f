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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_a_true_precision_casts_the_floating_point_tensors_of_each_batch(precision):
    """As Lightning's convert_input: under bf16-true a float batch reaches the step in bf16 (it
    used to fail at the first matmul, Float against BFloat16); integer tensors are left alone."""
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from zerotrain import Trainer, TrainModule

    seen = []

    class Net(TrainModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            seen.append((x.dtype, y.dtype))
            return nn.functional.cross_entropy(self.lin(x).float(), y)

        def validation_step(self, batch, batch_idx):
            seen.append((batch[0].dtype, batch[1].dtype))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    trainer = Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, num_sanity_val_steps=0)
    trainer.fit(Net(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    want = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert seen and all(s == (want, torch.int64) for s in seen), seen


def test_cast_floating_goes_through_every_container_a_batch_may_be():
    import collections
    import dataclasses
    from collections import UserDict

    from zerotrain.strategies.precision.base import cast_floating

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        ids: torch.Tensor

    Pair = collections.namedtuple("Pair", "x ids")
    x, ids = torch.randn(2, 3), torch.arange(2)
    dd = collections.defaultdict(list, {"x": x, "ids": ids})
    for batch in ([x, ids], (x, ids), Pair(x, ids), {"x": x, "ids": ids}, collections.OrderedDict(x=x, ids=ids),
                  dd, UserDict(x=x, ids=ids), Batch(x, ids)):
        out = cast_floating(batch, torch.bfloat16)
        assert type(out) is type(batch)
        got = out if isinstance(out, (list, tuple)) else (out.x, out.ids) if isinstance(out, Batch) \
            else (out["x"], out["ids"])
        assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.int64, type(batch)
        assert x.dtype == torch.float32  # the caller's batch is not changed in place
    assert cast_floating(dd, torch.bfloat16).default_factory is list


def test_the_engine_casts_a_bf16_true_models_float_inputs():
    from torch import nn

    from zerotrain import Engine

    engine = Engine(accelerator="cpu", devices=1, precision="bf16-true")
    net = nn.Linear(3, 2)
    model, _ = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert model(torch.randn(4, 3)).dtype == torch.bfloat16  # a float input no longer fails (Float vs BFloat16)
