"""``trainer.accelerator`` and the strategy classes' names as Lightning's (issue 41; Lightning's
trainer/test_trainer.py::test_trainer_config_strategy, whose test ids are built from the class
names): the accelerator is an Accelerator object ("auto" resolved), still equal to its name, and
the single-device and DDP strategies' classes are called SingleDeviceStrategy and DDPStrategy."""
from __future__ import annotations

import pytest
import torch

from zerotrain import DDP, DDPStrategy, SingleDevice, SingleDeviceStrategy, Trainer
from zerotrain.trainer.compat.lightning.accelerators import CPUAccelerator, CUDAAccelerator


def _trainer(**kw):
    return Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, **kw)


@pytest.mark.parametrize("flag", ["cpu", "auto"])
def test_accelerator_is_an_accelerator(flag):
    trainer = _trainer(accelerator=flag)
    want = CUDAAccelerator if flag == "auto" and torch.cuda.is_available() else CPUAccelerator
    assert isinstance(trainer.accelerator, want)
    assert trainer.accelerator == want.name  # what comparing the old string gave


@pytest.mark.parametrize("strategy, cls, devices", [("auto", SingleDeviceStrategy, 1), ("ddp", DDPStrategy, 1),
                                                     ("ddp", DDPStrategy, 2), ("ddp_spawn", DDPStrategy, 2)])
def test_strategy_classes_carry_lightnings_names(strategy, cls, devices):
    trainer = _trainer(strategy=strategy, accelerator="cpu", devices=devices)
    assert type(trainer.strategy) is cls
    assert type(trainer.strategy).__name__ == {"auto": "SingleDeviceStrategy"}.get(strategy, "DDPStrategy")
    assert trainer.num_devices == devices
    assert (DDP, SingleDevice) == (DDPStrategy, SingleDeviceStrategy)  # zerotrain's short names stay


def test_names_as_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    theirs = pl.Trainer(logger=False, accelerator="cpu", strategy="ddp", devices=2)
    ours = _trainer(accelerator="cpu", strategy="ddp", devices=2)
    assert type(ours.strategy).__name__ == type(theirs.strategy).__name__
    assert type(ours.accelerator).__name__ == type(theirs.accelerator).__name__
