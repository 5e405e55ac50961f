"""Lightning's weights-only checkpoints and checkpoint extensions, compared with pytorch-lightning:
``Trainer.save_checkpoint(path, weights_only=True)`` writes one file with Lightning's keys (no
optimizer, scheduler or callback state), ``load_from_checkpoint`` reads it and a resume from it is
Lightning's KeyError; a ModelCheckpoint subclass with its own ``FILE_EXTENSION`` writes files, as
Lightning's does, not checkpoint folders."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import ModelCheckpoint


def _module(base):
    class M(base):
        def __init__(self, width=2):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)),
                              batch_size=2)

    return M


def _fit(trainer_cls, module_cls, root, **kwargs):
    trainer = trainer_cls(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, max_steps=1, default_root_dir=str(root), **kwargs)
    trainer.fit(module_cls())
    return trainer


def test_save_checkpoint_weights_only_as_lightning(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    theirs = _fit(pl.Trainer, _module(pl.LightningModule), tmp_path / "pl", enable_checkpointing=False)
    theirs.save_checkpoint(tmp_path / "pl.ckpt", weights_only=True)
    M = _module(TrainModule)
    ours = _fit(Trainer, M, tmp_path / "zt", enable_checkpointing=False)
    for name in ("zt.ckpt", "zt_weights"):  # a file whatever the name, as Lightning's
        ours.save_checkpoint(tmp_path / name, weights_only=True)
        assert os.path.isfile(tmp_path / name)
    want = torch.load(tmp_path / "pl.ckpt", weights_only=True)
    got = torch.load(tmp_path / "zt.ckpt", weights_only=True)
    assert not {"optimizer_states", "lr_schedulers", "callbacks"} & set(got)
    assert set(want) <= set(got) and set(got) - set(want) <= {"format", "hparams_name", "hparams_type"}
    assert got["state_dict"].keys() == want["state_dict"].keys()
    torch.testing.assert_close(got["state_dict"], dict(ours.module.state_dict()))
    assert got["global_step"] == want["global_step"] == 1
    loaded = M.load_from_checkpoint(tmp_path / "zt.ckpt")
    torch.testing.assert_close(dict(loaded.state_dict()), dict(ours.module.state_dict()))
    with pytest.raises(KeyError, match="checkpoint contains only the model"):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=2,
                enable_checkpointing=False, default_root_dir=str(tmp_path / "again")).fit(M(), ckpt_path=tmp_path / "zt.ckpt")


def test_model_checkpoint_file_extension_writes_files(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    listing = {}
    for lib, trainer_cls, base, mc in (("pl", pl.Trainer, pl.LightningModule, pl.callbacks.ModelCheckpoint),
                                       ("zt", Trainer, TrainModule, ModelCheckpoint)):
        cb = type("Ext", (mc,), {"FILE_EXTENSION": ".tpkc"})(dirpath=str(tmp_path / lib), save_last=True)
        _fit(trainer_cls, _module(base), tmp_path / lib, callbacks=[cb])
        listing[lib] = {(n, os.path.isfile(tmp_path / lib / n)) for n in os.listdir(tmp_path / lib)}
    assert listing["zt"] == listing["pl"] == {("epoch=0-step=1.tpkc", True), ("last.tpkc", True)}
