"""When each training pass's DataLoader iterator is made, against pytorch-lightning 2.6 running the
same module: making one draws the loader's base seed from the global RNG, so a module that draws
random numbers in ``on_train_start`` or ``on_train_epoch_start`` (weights initialised there, as
Lightning's tensor_parallel example does) sees the stream Lightning's does only if the iterators
come at Lightning's points: the first pass's before ``on_train_start``, every later pass's after
``on_train_epoch_start``, and a reloaded loader's once more before it.

Each run records the random numbers its hooks drew. The loader does not shuffle: on one process a
shuffled loader's RandomSampler draws its own seed each pass in Lightning, where zerotrain orders it
by a DistributedSampler (seed, epoch) so a resumed run continues exactly (trainer/data/loaders.py
says so in the log); on several processes both use the DistributedSampler."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(120)


def _module(base):
    class Draws(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(1, 1)
            self.drawn, self.seen = [], []

        def on_train_start(self):
            self.drawn.append(("start", torch.rand(()).item()))

        def on_train_epoch_start(self):
            self.drawn.append(("epoch", torch.rand(()).item()))

        def training_step(self, batch, batch_idx):
            self.seen += batch[0].flatten().tolist()
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.arange(8.0).unsqueeze(1)), batch_size=2)

    return Draws()


QUIET = dict(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0)


@pytest.mark.parametrize("reload", [0, 1])
def test_hooks_draw_lightnings_random_numbers(tmp_path, reload):
    pl = pytest.importorskip("pytorch_lightning")
    runs = []
    for trainer_cls, base, extra in ((Trainer, TrainModule, {}), (pl.Trainer, pl.LightningModule, {"accelerator": "cpu"})):
        torch.manual_seed(0)
        module = _module(base)
        trainer_cls(default_root_dir=tmp_path, reload_dataloaders_every_n_epochs=reload, **QUIET, **extra).fit(module)
        runs.append((module.drawn, module.seen))
    (ours_drawn, ours_seen), (theirs_drawn, theirs_seen) = runs
    assert [k for k, _ in ours_drawn] == ["start", "epoch", "epoch", "epoch"]
    assert ours_drawn == theirs_drawn
    assert ours_seen == theirs_seen  # the same batches
