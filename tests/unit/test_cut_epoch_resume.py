"""A fit that max_steps cuts mid-epoch ends that epoch (as Lightning: current_epoch moves on), and
whatever resumes from its checkpoint continues the epoch's remaining batches (LoopState.cut_batches):
the Trainer (tests/unit/test_conformance_examples_basics.py) and here the Engine."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Engine, Trainer, TrainModule

N, BS = 40, 4  # 10 batches an epoch; max_steps=3 cuts epoch 0 after its third


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.zeros(N, 1))


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_the_engine_resumes_a_trainer_checkpoint_cut_by_max_steps_in_the_cut_epoch(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", max_steps=3, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(Net(), DataLoader(_data(), batch_size=BS))
    assert (trainer.current_epoch, trainer.state.cut_batches) == (1, 3)  # the epoch ended, as Lightning's
    trainer.save_checkpoint(str(tmp_path / "cut.ckpt"))

    engine = Engine(accelerator="cpu", devices=1, strategy="single")
    model = Net()
    model, optimizer = engine.setup(model, model.configure_optimizers())
    loader = engine.setup_dataloaders(DataLoader(_data(), batch_size=BS))
    engine.load(str(tmp_path / "cut.ckpt"), {"model": model, "optimizer": optimizer})
    assert (engine.progress.epoch, engine.progress.batches_in_epoch, engine.progress.cut_batches) == (0, 3, 0)
    first = next(iter(loader))[0].flatten()
    assert first.tolist() == [12.0, 13.0, 14.0, 15.0]  # epoch 0's fourth batch, not epoch 1's first
