"""Issue 41: what Lightning's tests see of the training step from outside: every backward of a
loss goes through ``Tensor.backward`` (code that wraps or counts it sees each one), compared with
pytorch-lightning 2.6 in the same test (skipped when it is missing)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(120)


def _module(base):
    class Small(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=2)

    return Small()


_QUIET = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_micro_batch_backward_goes_through_tensor_backward(tmp_path, accumulate):
    with mock.patch("torch.Tensor.backward") as ours:
        Trainer(default_root_dir=tmp_path, accumulate_grad_batches=accumulate, **_QUIET).fit(_module(TrainModule))
    pl = pytest.importorskip("pytorch_lightning")
    with mock.patch("torch.Tensor.backward") as theirs:
        pl.Trainer(default_root_dir=tmp_path, accumulate_grad_batches=accumulate, accelerator="cpu", **_QUIET).fit(
            _module(pl.LightningModule))
    assert ours.call_count == theirs.call_count == 6


def _twice(base):
    """Manual optimization backwarding one graph twice: needs ``retain_graph=True`` the first time."""

    class Twice(_module(base).__class__):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = self.net(batch[0]).pow(2).mean()
            self.manual_backward(loss, None, True)  # Tensor.backward's positional (gradient, retain_graph)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()

    return Twice()


def test_manual_backward_passes_its_arguments_to_tensor_backward(tmp_path):
    torch.manual_seed(0)
    ours = _twice(TrainModule)
    Trainer(default_root_dir=tmp_path, **_QUIET).fit(ours)
    pl = pytest.importorskip("pytorch_lightning")
    torch.manual_seed(0)
    theirs = _twice(pl.LightningModule)
    pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", **_QUIET).fit(theirs)
    torch.testing.assert_close(ours.net.weight, theirs.net.weight, rtol=0, atol=0)
