"""EarlyStopping stops every rank at the same step, even when only one rank's metric says stop
(a rank-local metric, logged without sync_dist)."""
import torch
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import EarlyStopping


class RankLocal(TrainModule):
    """Rank 1's metric stops improving after epoch 1; rank 0's improves every epoch."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.epochs = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        value = 1.0 if self.global_rank == 1 and self.epochs >= 1 else 1.0 / (self.epochs + 2)
        self.log("train_metric", value)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)),
                          batch_size=2)


class CountEpochs(EarlyStopping):
    def on_train_epoch_end(self, trainer, module):
        super().on_train_epoch_end(trainer, module)
        module.epochs += 1


def _fit():
    cb = CountEpochs(monitor="train_metric", patience=1, check_on_train_epoch_end=True)
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=10, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, callbacks=[cb])
    trainer.fit(RankLocal())
    return {"global_step": trainer.global_step, "should_stop": trainer.should_stop, "wait": cb.wait_count}


def test_early_stopping_stops_every_rank_together(tmp_path):
    r0, r1 = run_ranks("test_early_stopping:_fit", 2, tmp_path, timeout=120)
    # 2 steps per epoch per rank; rank 1's metric gets worse at its second check (epoch 1's end)
    assert r0["global_step"] == r1["global_step"] == 4
    assert r0["should_stop"] and r1["should_stop"]
    assert (r0["wait"], r1["wait"]) == (0, 1)  # only rank 1 decided; rank 0 followed
