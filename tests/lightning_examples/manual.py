"""The BoringModel trained with manual optimization, as Lightning's manual-optimization guide
writes it: ``self.optimizers()``, ``self.lr_schedulers()``, ``self.manual_backward``, gradients
accumulated over two batches, ``self.clip_gradients`` before the step, the scheduler stepped by
the module at the end of each epoch. Imports pytorch_lightning only (the runner renames it)."""
import torch
from torch.utils.data import DataLoader, Dataset

import pytorch_lightning as pl
from pytorch_lightning import LightningDataModule, LightningModule, Trainer


class Features(Dataset):
    def __init__(self, length: int, generator: torch.Generator):
        self.x = torch.randn(length, 32, generator=generator)
        self.y = torch.randn(length, 2, generator=generator)

    def __getitem__(self, index):
        return self.x[index], self.y[index]

    def __len__(self):
        return len(self.x)


class FeaturesDataModule(LightningDataModule):
    def setup(self, stage: str):
        g = torch.Generator().manual_seed(7)
        self.train_set, self.val_set = Features(48, g), Features(16, g)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=4)


class ManualBoringModel(LightningModule):
    def __init__(self, lr: float = 0.05, accumulate: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss / self.hparams.accumulate)
        if (batch_idx + 1) % self.hparams.accumulate == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", opt.param_groups[0]["lr"], on_step=False, on_epoch=True)

    def on_train_epoch_end(self):
        self.lr_schedulers().step()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        return [opt], [torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)]


def main(**trainer_kwargs):
    pl.seed_everything(3)
    model, dm = ManualBoringModel(), FeaturesDataModule()
    trainer = Trainer(max_epochs=3, log_every_n_steps=2, **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    return trainer, model, {"validate": trainer.validate(model, datamodule=dm, verbose=False)}
