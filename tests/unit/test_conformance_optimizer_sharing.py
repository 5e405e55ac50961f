"""One parameter in several optimizers (issue 41; upstream's LR-monitor, manual-optimization and
toggle tests build two optimizers on ``self.parameters()``): Lightning allows it; so do the
replicated strategies, each optimizer keeping, stepping and checkpointing its own state of the
parameter; ZeRO refuses it naming the strategy."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.strategies.optimizers import OptimizerSet

STEPS = 3


def _data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(4 * STEPS, 5, generator=g), torch.randn(4 * STEPS, 2, generator=g))


class Shared(TrainModule):
    """Two Adams over the same Linear (different learning rates), stepped one after the other."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.layer = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt in self.optimizers():
            loss = (self.layer(x) - y).pow(2).mean()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.layer.parameters(), lr=0.1), torch.optim.Adam(self.layer.parameters(), lr=0.01)]

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=4)


def _trainer(**kw):
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _plain_loop():
    """The same run as a plain PyTorch loop: the reference, bit for bit."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 2)
    opts = [torch.optim.Adam(layer.parameters(), lr=0.1), torch.optim.Adam(layer.parameters(), lr=0.01)]
    for x, y in DataLoader(_data(), batch_size=4):
        for opt in opts:
            loss = (layer(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return layer, opts


def test_a_parameter_in_two_optimizers_trains_as_a_plain_loop():
    model, trainer = Shared(), _trainer(max_epochs=1)
    trainer.fit(model)
    layer, opts = _plain_loop()
    assert trainer.global_step == 2 * STEPS
    for ours, ref in zip(model.layer.parameters(), layer.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # tolerance: exact, same ops in the same order
    for k in range(2):
        for p, q in zip(model.layer.parameters(), layer.parameters()):
            for key, v in opts[k].state[q].items():
                torch.testing.assert_close(trainer.optimizers[k].state[p][key], v, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["shared.ckpt", "shared_dir"])
def test_each_optimizers_state_of_a_shared_parameter_is_checkpointed_and_resumed(tmp_path, name):
    """A file (Lightning's layout) and a directory: both optimizers' states of every parameter
    come back, each to its own optimizer (before the fix the set refused the parameter; with
    one state per parameter the second optimizer's would be lost)."""
    model, trainer = Shared(), _trainer(max_epochs=1)
    trainer.fit(model)
    path = tmp_path / name
    trainer.save_checkpoint(path)
    again, resumed = Shared(), _trainer(max_epochs=1)
    resumed.fit(again, ckpt_path=str(path))  # the epoch is done: loads, trains nothing
    assert resumed.global_step == trainer.global_step
    for k in range(2):
        for p, q in zip(again.layer.parameters(), model.layer.parameters()):
            saved, back = trainer.optimizers[k].state[q], resumed.optimizers[k].state[p]
            assert sorted(back) == sorted(saved)
            for key in saved:
                torch.testing.assert_close(back[key], saved[key], rtol=0, atol=0)  # tolerance: a copy
    assert not torch.equal(resumed.optimizers[0].state[again.layer.weight]["exp_avg_sq"],
                           resumed.optimizers[1].state[again.layer.weight]["exp_avg_sq"])


def test_zero_refuses_a_shared_parameter_naming_the_strategy():
    from zerotrain.strategies import strategy_from_name

    layer = nn.Linear(3, 2)
    s = strategy_from_name("zero2")
    s.module = layer
    both = OptimizerSet([torch.optim.SGD(layer.parameters(), lr=1), torch.optim.SGD([layer.weight], lr=1)])
    with pytest.raises(ValueError, match=r"^strategy='zero2': parameter 'weight' is in optimizers 0 and 1, .*"
                                         r"valid: give each parameter to one optimizer, or a replicated strategy"):
        s.setup_optimizer(both)


def test_the_engine_takes_a_shared_parameter_under_a_replicated_strategy():
    from zerotrain import Engine

    engine = Engine(strategy="single", devices=1, accelerator="cpu")
    layer = nn.Linear(3, 2)
    _, o1, o2 = engine.setup(layer, torch.optim.SGD(layer.parameters(), lr=1.0),
                             torch.optim.SGD([layer.weight], lr=0.5))
    before = layer.weight.detach().clone()
    for opt in (o1, o2):  # the Engine's step zeroes its optimizer's gradients: one backward each
        engine.backward(layer(torch.ones(1, 3)).sum())
        opt.step()
    # each optimizer stepped the weight on the same gradient (ones): lr 1.0, then 0.5
    torch.testing.assert_close(layer.weight, before - 1.5, rtol=0, atol=1e-6)  # tolerance: two fp32 roundings
