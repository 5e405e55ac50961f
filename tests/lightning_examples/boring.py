"""A BoringModel with its DataModule, written as Lightning's demos write them: random features,
a small network, ``self.log`` per step and per epoch (``prog_bar``, ``sync_dist``), validation and
test, a per-epoch LR schedule. Imports pytorch_lightning only: ``run_examples.py`` renames it to
run under zerotrain (the porting rule), and ``main`` is what both sides run."""
import torch
from torch.utils.data import DataLoader, Dataset

import pytorch_lightning as pl
from pytorch_lightning import LightningDataModule, LightningModule, Trainer


class RandomDataset(Dataset):
    def __init__(self, size: int, length: int, generator: torch.Generator):
        self.len = length
        self.data = torch.randn(length, size, generator=generator)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringDataModule(LightningDataModule):
    def __init__(self, size: int = 32, batch_size: int = 4):
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def setup(self, stage: str):
        g = torch.Generator().manual_seed(1234)  # the same data on every rank, whatever ran before
        self.train_set = RandomDataset(self.size, 64, g)
        self.val_set = RandomDataset(self.size, 24, g)
        self.test_set = RandomDataset(self.size, 20, g)  # 20 / 2 ranks / 4: an uneven last batch

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)


class BoringModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, x):
        return self.layer(x)

    def loss(self, preds):
        return torch.nn.functional.mse_loss(preds, torch.ones_like(preds))

    def training_step(self, batch, batch_idx):
        loss = self.loss(self(batch))
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train_max", batch.abs().max(), on_step=False, on_epoch=True, reduce_fx="max")
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_end_marker", float(self.trainer.current_epoch))

    def validation_step(self, batch, batch_idx):
        loss = self.loss(self(batch))
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_loss_local", loss)  # rank-local: each rank's own mean

    def test_step(self, batch, batch_idx):
        loss = self.loss(self(batch))
        self.log_dict({"test_loss": loss, "test_sq": loss * loss}, sync_dist=True)
        self.log("test_min", loss, reduce_fx="min", sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def main(**trainer_kwargs):
    """Fit for 2 epochs, then validate and test; returns the trainer, the model and the results."""
    pl.seed_everything(42)
    model, dm = BoringModel(), BoringDataModule()
    trainer = Trainer(max_epochs=2, log_every_n_steps=3, **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    results = {"validate": trainer.validate(model, datamodule=dm, verbose=False),
               "test": trainer.test(model, datamodule=dm, verbose=False)}
    return trainer, model, results
