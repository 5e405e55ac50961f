"""The loop's phases (the progress watchdog's ticks, the ResourceMonitor's step-time parts) are
marked where hooks are dispatched: a loop hook marks its own name, then once per callback; the
loop's call sites mark only what is no hook (``training_step``, ``backward``, ``optimizer_step``,
fetching the next batch). One training step's phases, in order, are pinned here."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, Trainer, TrainModule
from zerotrain.trainer.loop.hooks import HookDispatcher

pytestmark = pytest.mark.timeout(120)


class Cb(Callback):
    pass


class Tiny(TrainModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_dispatcher_marks_a_loop_hook_then_each_callback_and_no_other_hook():
    phases = []
    hooks = HookDispatcher([Cb(), Cb()], mark=phases.append)
    module = Tiny()
    hooks.both("on_train_epoch_start", None, module)
    assert phases == ["on_train_epoch_start", "on_train_epoch_start (Cb)", "on_train_epoch_start (Cb)"]
    hooks.both("on_fit_start", None, module)  # not one every rank calls at the same place of the loop
    hooks.mark("optimizer_step")
    assert phases[3:] == ["optimizer_step"]
    HookDispatcher([Cb()]).both("on_train_epoch_start", None, module)  # no marker: nothing marked


def test_one_training_step_marks_each_phase_once_in_order(tmp_path, monkeypatch):
    phases = []
    monkeypatch.setattr(Trainer, "_tick", lambda self, phase: phases.append(phase))
    data = TensorDataset(torch.randn(2, 2), torch.randn(2, 1))
    trainer = Trainer(max_steps=1, callbacks=[Cb()], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), DataLoader(data, batch_size=2))
    step = phases[phases.index("on_train_epoch_start"):]
    hook = lambda name: [name, f"{name} (Cb)"]  # noqa: E731
    assert step == [*hook("on_train_epoch_start"), *hook("on_train_batch_start"), "training_step",
                    *hook("on_before_zero_grad"), *hook("on_before_backward"), "backward",
                    *hook("on_after_backward"), *hook("on_before_optimizer_step"), "optimizer_step",
                    *hook("on_train_batch_end"), "agreeing on stop signals", "fetching the next training batch",
                    *hook("on_train_epoch_end")]
