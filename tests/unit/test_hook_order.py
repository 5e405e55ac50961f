"""The Trainer calls the module's hooks as well as the callbacks', in Lightning's order: one fit
(2 epochs x 2 batches, validation each epoch) + validate + test + predict run under zerotrain and
under pytorch-lightning 2.6 records the same sequence of hook calls (with their arguments'
essentials), the module-only hooks around an evaluation (``MODE_HOOKS``) included."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, Trainer, TrainModule
from zerotrain.trainer.loop.hooks import HOOKS, MODULE_HOOKS

#: the module-only hooks around an evaluation (``trainer/loop/model_mode.py``), recorded too
MODE_HOOKS = ("on_validation_model_eval", "on_validation_model_train", "on_test_model_eval",
              "on_test_model_train", "on_predict_model_eval", "on_validation_model_zero_grad")


def _data(n=4):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g))


def _essentials(hook, args):
    """What of a hook's arguments is compared: the stage of setup/teardown and the batch index of
    batch hooks (Lightning passes both positionally or by keyword; both are normalised here)."""
    if hook in ("setup", "teardown"):
        stage = args.get("stage")
        return (hook, getattr(stage, "value", stage))  # Lightning's TrainerFn: its string
    if "batch_idx" in args:
        return (hook, args["batch_idx"])
    return (hook,)


def _bind(hook, names, args, kwargs):
    out = dict(zip(names, args))
    out.update(kwargs)
    return out


_ARG_NAMES = {
    "setup": ("stage",), "teardown": ("stage",),
    "on_train_batch_start": ("batch", "batch_idx"),
    "on_train_batch_end": ("outputs", "batch", "batch_idx"),
    **{f"on_{s}_batch_start": ("batch", "batch_idx", "dataloader_idx") for s in ("validation", "test", "predict")},
    **{f"on_{s}_batch_end": ("outputs", "batch", "batch_idx", "dataloader_idx")
       for s in ("validation", "test", "predict")},
}

#: the hooks recorded: every callback hook both libraries know, plus the module-only ones
RECORDED = sorted(set(HOOKS) - {"on_exception", "on_save_checkpoint", "on_load_checkpoint"}
                  | set(MODULE_HOOKS) - {"configure_callbacks", "on_save_checkpoint", "on_load_checkpoint"}
                  | set(MODE_HOOKS))


def _recorder(who, calls, hook, n_fixed):
    """A method that appends ``(who, hook, essentials)``; ``n_fixed`` leading arguments
    (trainer and module for a callback) are dropped."""
    def method(self, *args, **kwargs):
        bound = _bind(hook, _ARG_NAMES.get(hook, ()), args[n_fixed:], kwargs)
        calls.append((who,) + _essentials(hook, bound))
    method.__name__ = hook
    return method


def make_recording(base_module, base_callback, calls):
    """The same module and callback for both libraries, each hook recording its call."""
    mod_hooks = {h: _recorder("module", calls, h, 0) for h in RECORDED if h not in ("on_before_backward",)}
    mod_hooks["on_before_backward"] = _recorder("module", calls, "on_before_backward", 1)
    cb_hooks = {h: _recorder("callback", calls, h, 2) for h in RECORDED}

    class Rec(base_module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        test_step = validation_step

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=2)

        def val_dataloader(self):
            return DataLoader(_data(), batch_size=2)

        def test_dataloader(self):
            return DataLoader(_data(), batch_size=2)

        def predict_dataloader(self):
            return DataLoader(_data(), batch_size=2)

    for name, fn in mod_hooks.items():
        if name == "on_before_backward":
            setattr(Rec, name, lambda self, loss, _f=fn: _f(self, loss))
        else:
            setattr(Rec, name, fn)
    RecCallback = type("RecCallback", (base_callback,), cb_hooks)
    return Rec(), RecCallback()


def _run(trainer, module):
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    trainer.test(module, verbose=False)
    trainer.predict(module)


def _ending_epoch_0(module, calls):
    """The module's ``on_train_batch_start`` returns -1 at batch 1 of epoch 0: the epoch ends."""
    record = type(module).on_train_batch_start

    def on_train_batch_start(self, batch, batch_idx):
        record(self, batch, batch_idx)
        return -1 if (self.trainer.current_epoch, batch_idx) == (0, 1) else None
    type(module).on_train_batch_start = on_train_batch_start
    return module


def _lightning_calls(tmp_path, edit=lambda module, calls: module, run=_run):
    pl = pytest.importorskip("pytorch_lightning")
    calls = []
    module, cb = make_recording(pl.LightningModule, pl.Callback, calls)
    module = edit(module, calls)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_epochs=2, limit_val_batches=1, callbacks=[cb], default_root_dir=str(tmp_path))
    run(trainer, module)
    return calls


def _our_calls(tmp_path, edit=lambda module, calls: module, run=_run):
    calls = []
    module, cb = make_recording(TrainModule, Callback, calls)
    module = edit(module, calls)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      max_epochs=2, limit_val_batches=1, callbacks=[cb],
                      default_root_dir=str(tmp_path))
    run(trainer, module)
    return calls


def test_hook_order_matches_lightning(tmp_path):
    want = _lightning_calls(tmp_path / "pl")
    got = _our_calls(tmp_path / "zt")
    assert ("module", "on_validation_model_zero_grad") in got and ("module", "on_test_model_train") in got
    assert ("module", "on_train_batch_start", 1) in got and ("module", "teardown", "predict") in got
    assert got == want


def test_train_batch_start_minus_one_ends_the_epoch(tmp_path):
    """-1 from the module's ``on_train_batch_start`` ends the epoch before that batch, as Lightning."""
    fit = lambda trainer, module: trainer.fit(module)  # noqa: E731
    want = _lightning_calls(tmp_path / "pl", _ending_epoch_0, fit)
    got = _our_calls(tmp_path / "zt", _ending_epoch_0, fit)
    assert ("callback", "on_train_batch_end", 1) in got  # epoch 1 runs its batch 1
    assert got == want
