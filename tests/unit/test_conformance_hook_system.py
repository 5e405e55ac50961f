"""Hooks of a fit that Lightning's own hook-system test records (models/test_hooks.py), compared
with pytorch-lightning 2.6: when the data hooks are asked (``val_dataloader`` after
``on_sanity_check_start``, ``train_dataloader`` after ``on_sanity_check_end``, before
``on_train_start``), the module's ``backward`` hook between ``on_before_backward`` and
``on_after_backward`` (automatic and ``manual_backward``), ``configure_gradient_clipping``'s
keyword arguments, and ``is_overridden`` of a hook wrapped (functools.partial) after being set to None."""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, Trainer, TrainModule
from zerotrain.trainer.utilities import is_overridden

#: the module methods recorded (with the keyword names of the calls that pass keywords)
RECORDED = ("prepare_data", "setup", "configure_optimizers", "on_fit_start", "train_dataloader",
            "val_dataloader", "on_train_start", "on_before_backward", "backward", "on_after_backward",
            "configure_gradient_clipping", "manual_backward", "optimizer_step", "on_fit_end")
CALLBACK = ("on_sanity_check_start", "on_sanity_check_end", "on_train_start", "on_fit_start")


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g))


def _module(base, automatic):
    class M(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            if automatic:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def validation_step(self, batch, batch_idx):
            self.log("v", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=2)

        def val_dataloader(self):
            return DataLoader(_data(), batch_size=2)

    return M()


def _record(module, callback_base, calls):
    """Wrap each recorded method of ``module`` (as Lightning's HookedModel does: a partial per
    instance) and make a callback recording its hooks."""
    def call(name, fn, *args, **kwargs):  # recorded when it returns, as Lightning's HookedModel
        out = fn(*args, **kwargs)
        calls.append((name, tuple(sorted(kwargs))))
        return out

    for name in RECORDED:
        fn = getattr(module, name)
        setattr(module, name, functools.update_wrapper(functools.partial(call, name, fn), fn))
    hooks = {h: (lambda h: lambda self, *a, **k: calls.append((f"Callback.{h}", ())))(h) for h in CALLBACK}
    return type("Rec", (callback_base,), hooks)()


def _calls(trainer_cls, module_base, callback_base, automatic, tmp_path):
    calls = []
    module = _module(module_base, automatic)
    cb = _record(module, callback_base, calls)
    trainer = trainer_cls(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                          limit_train_batches=1, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[cb],
                          default_root_dir=str(tmp_path))
    trainer.fit(module)
    return calls


@pytest.mark.parametrize("automatic", [True, False])
def test_fit_hooks_as_lightning(tmp_path, automatic):
    pl = pytest.importorskip("pytorch_lightning")
    want = _calls(pl.Trainer, pl.LightningModule, pl.Callback, automatic, tmp_path / "pl")
    got = _calls(Trainer, TrainModule, Callback, automatic, tmp_path / "zt")
    names = [n for n, _ in got]
    assert names.index("val_dataloader") > names.index("Callback.on_sanity_check_start")
    assert names.index("Callback.on_sanity_check_end") < names.index("train_dataloader") < names.index("on_train_start")
    assert "backward" in names
    assert got == want


def test_backward_hook_overrides_autograd(tmp_path):
    """An overridden ``backward`` is what runs autograd (here: it doubles the loss, so the
    gradient doubles)."""
    grads = {}

    def run(doubled):
        torch.manual_seed(0)
        module = _module(TrainModule, True)
        if doubled:
            module.backward = lambda loss, *a, **k: (2 * loss).backward(*a, **k)
        module.on_after_backward = lambda: grads.__setitem__(doubled, module.net.weight.grad.clone())
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_steps=1, num_sanity_val_steps=0,
                limit_val_batches=0, default_root_dir=str(tmp_path)).fit(module)
    run(False)
    run(True)
    torch.testing.assert_close(grads[True], 2 * grads[False])


def test_is_overridden_of_a_wrapped_none():
    class M(TrainModule):
        pass
    M.configure_model = None
    m = M()
    m.configure_model = functools.update_wrapper(functools.partial(print), lambda: None)  # a wrapper ...
    m.configure_model.__wrapped__ = None  # ... of None, as update_wrapper(partial(f, None), None) makes
    assert not is_overridden("configure_model", m)
    assert is_overridden("training_step", _module(TrainModule, True))
