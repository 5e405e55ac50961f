"""Resuming from a checkpoint saved while an epoch ends (issue 41, Lightning's models/test_restore.py):
``last.ckpt`` written by ModelCheckpoint in the epoch-end validation or in ``on_train_epoch_end``
holds ``epoch`` = the ending epoch, yet a fit from it starts the next epoch (``current_epoch`` is
already the next one in ``on_train_start``, no hook of the saved epoch runs again) while
validate/test from it see the saved epoch. Compared with pytorch-lightning where installed."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets it on import
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))


def _resume(L, root, val_batches, max_steps=-1):
    """Fit 1 epoch of 2 batches saving last.ckpt, then fit to 3 epochs / validate from it: what each saw."""
    seen: list = []

    class Model(L.LightningModule if hasattr(L, "LightningModule") else L.TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def _data(self):
            return DataLoader(TensorDataset(torch.arange(16.0).view(4, 4)), batch_size=2)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("v", self.layer(batch[0]).mean())

        def on_train_start(self):
            seen.append(("train_start", self.trainer.current_epoch, self.trainer.global_step))

        def on_train_epoch_start(self):
            seen.append(("epoch_start", self.trainer.current_epoch))

        def on_train_batch_start(self, batch, batch_idx):
            seen.append(("batch", self.trainer.current_epoch, batch_idx, batch[0][0, 0].item()))

        def on_train_epoch_end(self):
            seen.append(("epoch_end", self.trainer.current_epoch))

        def on_validation_start(self):
            seen.append(("val_start", self.trainer.current_epoch, self.trainer.global_step))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        train_dataloader = val_dataloader = _data

    args = dict(default_root_dir=root, accelerator="cpu", devices=1, logger=False, num_sanity_val_steps=0,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=val_batches)
    ckpt = L.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    L.Trainer(max_epochs=1, callbacks=[ckpt], **args).fit(Model())
    last = os.path.join(root, "last.ckpt")
    saved = torch.load(last, weights_only=True)["epoch"]
    seen.clear()
    L.Trainer(max_epochs=3 if max_steps == -1 else None, max_steps=max_steps, enable_checkpointing=False,
              **args).fit(Model(), ckpt_path=last)
    fit, seen[:] = list(seen), []
    L.Trainer(max_epochs=3, enable_checkpointing=False, **args).validate(Model(), ckpt_path=last, verbose=False)
    return {"saved_epoch": int(saved), "fit": fit, "validate": list(seen)}


@pytest.mark.parametrize("val_batches", [2, 0], ids=["saved-in-validation", "saved-in-on_train_epoch_end"])
def test_a_fit_from_an_epoch_end_checkpoint_starts_the_next_epoch_as_lightning(tmp_path, val_batches):
    import zerotrain
    mine = _resume(zerotrain, str(tmp_path / "z"), val_batches)
    assert mine["saved_epoch"] == 0
    assert mine["fit"][0] == ("train_start", 1, 2)
    assert ("epoch_start", 0) not in mine["fit"] and ("epoch_end", 0) not in mine["fit"]
    assert mine["fit"][1:4] == [("epoch_start", 1), ("batch", 1, 0, 0.0), ("batch", 1, 1, 8.0)]
    if val_batches:
        assert mine["validate"] == [("val_start", 0, 0)]  # global_step 0 outside fit, as Lightning
    try:
        import pytorch_lightning
    except ImportError:
        return
    assert mine == _resume(pytorch_lightning, str(tmp_path / "pl"), val_batches)


def test_with_max_steps_on_train_start_keeps_the_saved_epoch_as_lightning(tmp_path):
    """Lightning's iteration-based training (the resuming fit has max_steps): current_epoch in
    on_train_start is the saved one; zerotrain's batches are then the next epoch's. (Lightning
    there runs the saved epoch on, its batch index past the loader's length, from a new iterator,
    and its on_train_epoch_end again; zerotrain does not: only on_train_start is compared.)"""
    import zerotrain

    def essentials(seen):
        return [e for e in seen["fit"] if e[0] == "train_start"]

    mine = _resume(zerotrain, str(tmp_path / "z"), 0, max_steps=6)
    assert essentials(mine) == [("train_start", 0, 2)]
    assert mine["fit"][1:4] == [("epoch_start", 1), ("batch", 1, 0, 0.0), ("batch", 1, 1, 8.0)]
    try:
        import pytorch_lightning
    except ImportError:
        return
    assert essentials(mine) == essentials(_resume(pytorch_lightning, str(tmp_path / "pl"), 0, max_steps=6))
