"""``Trainer(gradient_clip_val=0)``: Lightning reads 0 as "no clipping" (its examples pass 0 to
switch clipping off); it is accepted here too and trains exactly as ``None``. A negative value is
still refused before training, naming the field."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.trainer.errors import ConfigError


class Net(TrainModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y) * 100  # big gradients: any clipping would show

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(clip):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    model = Net()
    Trainer(accelerator="cpu", devices=1, max_steps=4, gradient_clip_val=clip, logger=False,
            enable_checkpointing=False, enable_progress_bar=False).fit(model, DataLoader(data, batch_size=4))
    return model.net.weight.detach().clone()


def test_zero_means_no_clipping():
    off = _fit(None)
    assert torch.equal(_fit(0), off) and torch.equal(_fit(0.0), off)
    assert not torch.equal(_fit(0.01), off)  # clipping does change this run


def test_negative_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"gradient_clip_val=-1 must be a finite number >= 0"):
        Trainer(accelerator="cpu", devices=1, gradient_clip_val=-1)


def test_lightning_accepts_zero_too(monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    assert pl.Trainer(gradient_clip_val=0, logger=False, enable_checkpointing=False).gradient_clip_val == 0
