"""A small GAN in the style of Lightning's GAN template: a generator and a discriminator, two
optimizers of different kinds, manual optimization with ``toggle_optimizer``/``untoggle_optimizer``,
noise drawn from the global RNG as the template does, and ``self.log_dict`` of both losses.
Imports pytorch_lightning only (the runner renames it)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import pytorch_lightning as pl
from pytorch_lightning import LightningDataModule, LightningModule, Trainer


class RingSamples(Dataset):
    """'Real' data: points near a ring in 8 dimensions."""

    def __init__(self, length: int, generator: torch.Generator):
        angle = torch.rand(length, generator=generator) * 6.2832
        ring = torch.stack([angle.cos(), angle.sin()], 1).repeat(1, 4)
        self.data = ring + 0.05 * torch.randn(length, 8, generator=generator)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


class RingDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str):
        self.train_set = RingSamples(64, torch.Generator().manual_seed(11))

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Generator(nn.Module):
    def __init__(self, latent_dim: int):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(latent_dim, 32), nn.LeakyReLU(0.2), nn.Linear(32, 8), nn.Tanh())

    def forward(self, z):
        return self.model(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, x):
        return self.model(x)


class GAN(LightningModule):
    def __init__(self, latent_dim: int = 4, lr_g: float = 2e-3, lr_d: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim)
        self.discriminator = Discriminator()

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, y_hat, y):
        return nn.functional.binary_cross_entropy(y_hat, y)

    def training_step(self, batch, batch_idx):
        real = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], self.hparams.latent_dim).type_as(real)

        self.toggle_optimizer(opt_g)
        valid = torch.ones(real.size(0), 1).type_as(real)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = torch.zeros(real.size(0), 1).type_as(real)
        real_loss = self.adversarial_loss(self.discriminator(real), valid)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr_g, betas=(0.5, 0.999))
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=self.hparams.lr_d, momentum=0.9)
        return [opt_g, opt_d], []


def main(**trainer_kwargs):
    pl.seed_everything(5)
    model, dm = GAN(), RingDataModule()
    trainer = Trainer(max_epochs=2, log_every_n_steps=2, **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    return trainer, model, {}
