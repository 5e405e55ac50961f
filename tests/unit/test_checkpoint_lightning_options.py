"""ModelCheckpoint's Lightning options beside pytorch-lightning 2.6: save_on_exception,
save_last="link", every_n_train_steps=0 and a monitored metric that is not logged yet. Names
are compared without their ``.ckpt``."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import ModelCheckpoint
from zerotrain.utilities.exceptions import MisconfigurationException


def _module(base, fail_at=None, log_val=True, log_train_as=None):
    class M(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            if fail_at is not None and self.global_step == fail_at:
                raise RuntimeError("boom")
            loss = self.net(batch[0]).pow(2).mean()
            self.log(log_train_as or "train_metric", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            if log_val:
                self.log("val_metric", 1.0 / (1 + self.current_epoch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(2, 2)), batch_size=2)

    return M()


def _run(lib, tmp_path, module_kw=None, max_epochs=2, **ckpt):
    """Fit with a ModelCheckpoint under ``lib`` ("ours" / "lightning"); the saved names (no .ckpt),
    the link's target (if any), the callback and the exception fit raised (or None)."""
    if lib == "ours":
        trainer_cls, base, cb_cls = Trainer, TrainModule, ModelCheckpoint
    else:
        pl = pytest.importorskip("pytorch_lightning")
        trainer_cls, base, cb_cls = pl.Trainer, pl.LightningModule, pl.callbacks.ModelCheckpoint
    dirpath = tmp_path / lib
    cb = cb_cls(dirpath=str(dirpath), filename="{epoch}-{step}", **ckpt)
    trainer = trainer_cls(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, callbacks=[cb],
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          default_root_dir=str(tmp_path))
    error = None
    try:
        trainer.fit(_module(base, **(module_kw or {})))
    except Exception as exc:  # noqa: BLE001 - compared below
        error = exc
    names = sorted(n.removesuffix(".ckpt") for n in os.listdir(dirpath) if not n.startswith((".", "latest"))) \
        if dirpath.exists() else []
    link = dirpath / "last.ckpt"
    target = os.readlink(link).removesuffix(".ckpt") if link.is_symlink() else None
    return names, target, cb, error


def test_save_on_exception_saves_where_lightning_does(tmp_path):
    ours = _run("ours", tmp_path, {"fail_at": 3}, save_on_exception=True, save_last=False)
    theirs = _run("lightning", tmp_path, {"fail_at": 3}, save_on_exception=True, save_last=False)
    assert ours[0] == theirs[0] == ["epoch=0-step=3"]
    assert str(ours[3]) == str(theirs[3]) == "boom"
    # the saved state resumes
    resumed = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    resumed.fit(_module(TrainModule), ckpt_path=str(tmp_path / "ours" / "epoch=0-step=3.ckpt"))
    assert resumed.global_step == 4


def test_save_last_link_points_at_the_newest_checkpoint(tmp_path):
    ours = _run("ours", tmp_path, every_n_train_steps=3, save_last="link")
    theirs = _run("lightning", tmp_path, every_n_train_steps=3, save_last="link")
    assert ours[1] == theirs[1] == "epoch=1-step=6"  # no new save at the end: the link names the newest
    assert ours[0] == theirs[0]  # the newest only without monitor, and the link
    assert os.path.isfile(tmp_path / "ours" / "last.ckpt")  # the link resolves to the checkpoint file
    assert ours[2].last_model_path == str(tmp_path / "ours" / "last.ckpt")


def test_every_n_train_steps_zero_means_never(tmp_path):
    ours = _run("ours", tmp_path, every_n_train_steps=0, save_last=False)
    theirs = _run("lightning", tmp_path, every_n_train_steps=0, save_last=False)
    assert ours[0] == theirs[0] == []
    assert ours[3] is None and theirs[3] is None


def test_monitor_waits_until_the_metric_is_logged(tmp_path):
    # val_metric is logged by validation only: the step-triggered saves before it wait for it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _run("ours", tmp_path, monitor="val_metric", every_n_train_steps=3, save_top_k=-1, save_last=False)
        theirs = _run("lightning", tmp_path, monitor="val_metric", every_n_train_steps=3, save_top_k=-1,
                      save_last=False)
    assert ours[3] is None and theirs[3] is None
    assert ours[0] == theirs[0] == ["epoch=1-step=6"]
    said = [str(w.message) for w in caught if "could not find the monitored key" in str(w.message)]
    assert said == []  # Lightning 2.6.6 defers such a save to the validation end without a warning


def test_monitor_never_logged_fails_after_validation_as_lightning(tmp_path):
    ours = _run("ours", tmp_path, {"log_val": False}, monitor="val_metric", save_last=False)
    theirs = _run("lightning", tmp_path, {"log_val": False}, monitor="val_metric", save_last=False)
    assert isinstance(ours[3], MisconfigurationException) and type(theirs[3]).__name__ == "MisconfigurationException"
    assert str(ours[3]) == str(theirs[3])
