"""The module's hooks beyond their order (``test_hook_order.py``): ``configure_callbacks`` adds and
replaces callbacks as Lightning's, ``on_save_checkpoint``/``on_load_checkpoint`` carry the module's
extra state in the checkpoint's metadata (saved after the callbacks' hooks, loaded before them),
and a callback whose ``setup`` predates ``stage`` is still called, with one warning."""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, ModelCheckpoint, Trainer, TrainModule


def _loader():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)), batch_size=4)


class Net(TrainModule):
    def __init__(self, calls=None, extra=()):
        super().__init__()
        self.net, self.calls, self.extra = nn.Linear(2, 1), calls if calls is not None else [], list(extra)
        self.seen = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_callbacks(self):
        return self.extra

    def on_save_checkpoint(self, checkpoint):
        self.calls.append("module.on_save_checkpoint")
        checkpoint["net_extra"] = {"seen_steps": self.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.calls.append("module.on_load_checkpoint")
        self.seen = checkpoint["net_extra"]


class Noting(Callback):
    def __init__(self, calls=None):
        self.calls = calls if calls is not None else []
        self.fits = 0

    def on_fit_start(self, trainer, module):
        self.fits += 1

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.calls.append("callback.on_save_checkpoint")

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.calls.append("callback.on_load_checkpoint")


class NotingMore(Noting):
    pass


def _trainer(tmp_path, **kw):
    kw.setdefault("enable_checkpointing", False)
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
                   max_epochs=1, **kw)


def test_configure_callbacks_adds_and_replaces_as_lightning(tmp_path):
    kept, replaced, mine = Callback(), Noting(), NotingMore()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ck"))
    trainer = _trainer(tmp_path, callbacks=[ckpt, kept, replaced])
    trainer.fit(Net(extra=[mine]), _loader())
    # a subclass of a Trainer callback's type replaces it; a bare Callback stays; checkpoints go last
    assert trainer.callbacks == [kept, mine, ckpt]
    assert mine.fits == 1 and replaced.fits == 0


def test_module_state_rides_in_the_checkpoint(tmp_path):
    calls = []
    trainer = _trainer(tmp_path, callbacks=[Noting(calls)])
    trainer.fit(Net(calls), _loader())
    trainer.save_checkpoint(str(tmp_path / "ck"))
    assert calls == ["callback.on_save_checkpoint", "module.on_save_checkpoint"]  # Lightning's order
    calls.clear()
    module = Net(calls)
    _trainer(tmp_path, callbacks=[Noting(calls)], max_steps=3).fit(module, _loader(), ckpt_path=str(tmp_path / "ck"))
    assert module.seen == {"seen_steps": 2}
    assert calls[:2] == ["module.on_load_checkpoint", "callback.on_load_checkpoint"]  # Lightning's order


class OldStyle(Callback):
    """A callback written when ``setup``/``teardown`` took no ``stage``."""

    def __init__(self):
        self.calls = []

    def setup(self, trainer, module):
        self.calls.append("setup")

    def teardown(self, trainer, module):
        self.calls.append("teardown")


def test_a_setup_without_stage_is_called_and_warned_about_once(tmp_path, caplog):
    old = OldStyle()
    trainer = _trainer(tmp_path, callbacks=[old])
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        trainer.fit(Net(), _loader())
        trainer.fit(trainer.module, _loader())
    assert old.calls == ["setup", "teardown", "setup", "teardown"]
    warned = [r.getMessage() for r in caplog.records if "takes no stage" in r.getMessage()]
    assert len(warned) == 2 and "OldStyle.setup" in warned[0] and "OldStyle.teardown" in warned[1]
