"""Lightning's ``LightningOptimizer`` wrapper, ``toggle_optimizer`` and the automatic-optimization
hooks' arguments (issue 41; upstream core/test_lightning_optimizer.py, core/test_lightning_module.py),
compared with pytorch-lightning where it is installed."""
from __future__ import annotations

from copy import deepcopy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotrain import Trainer
from zerotrain.core.optimizer import LightningOptimizer
from zerotrain.demos.boring_classes import BoringModel


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def _wrappers():
    """(zerotrain's LightningOptimizer, pytorch-lightning's or None)."""
    try:
        from pytorch_lightning.core.optimizer import LightningOptimizer as Theirs
    except ImportError:
        Theirs = None
    return LightningOptimizer, Theirs


def test_built_from_an_optimizer_alone_it_is_that_optimizer_class_with_its_state():
    for Wrapper in filter(None, _wrappers()):
        model = nn.Linear(3, 4)
        adam = torch.optim.Adam(model.parameters(), lr=0.1)
        opt = Wrapper(adam)
        assert isinstance(opt, Wrapper) and isinstance(opt, torch.optim.Adam)
        assert type(opt).__name__ == "LightningAdam" and str(opt) == "Lightning" + str(adam)
        assert opt._optimizer is adam and opt.optimizer is adam
        assert opt.state is adam.state and opt.param_groups is adam.param_groups and opt.defaults is adam.defaults
        adam.param_groups[0]["lr"] = 1.0
        assert opt.param_groups[0]["lr"] == 1.0 and opt.state_dict() == adam.state_dict()
        other = Wrapper(torch.optim.Adam(model.parameters(), lr=100))
        other.load_state_dict(deepcopy(adam.state_dict()))
        assert other.param_groups[0]["lr"] == 1.0


def test_self_optimizers_are_lightning_named_wrappers_of_the_users_optimizer(tmp_path):
    class Model(BoringModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            from zerotrain.loops.optimization.automatic import Closure

            assert isinstance(optimizer_closure, Closure)
            assert optimizer.state is optimizer._optimizer.state
            self.returned = optimizer.step(closure=optimizer_closure)

        def training_step(self, batch, batch_idx):
            self.loss = super().training_step(batch, batch_idx)["loss"]
            return self.loss

    model = Model()
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    opt = model.optimizers()
    assert str(opt) == "Lightning" + str(opt.optimizer) and opt.optimizer is trainer.optimizers[0]
    assert torch.equal(model.returned, model.loss)  # the closure returns the step's loss
    assert model.returned.grad_fn is None  # detached, as Lightning's: no autograd graph outlives the step
    deepcopy(trainer.callbacks)  # Lightning's test_restore copies them (and the Trainer they reach)


def test_toggle_optimizer_keeps_lightnings_state_dict_of_flags():
    model = BoringModel()
    extra = nn.Linear(2, 2)
    model.extra = extra
    extra.bias.requires_grad_(False)
    first = torch.optim.SGD(model.layer.parameters(), lr=0.1)
    second = torch.optim.SGD(model.extra.parameters(), lr=0.1)
    model.trainer = SimpleNamespace(optimizers=[first, second])  # as upstream's Mock trainer
    assert model._param_requires_grad_state == {}
    model.toggle_optimizer(LightningOptimizer(first))
    assert not extra.weight.requires_grad and model.layer.weight.requires_grad
    assert model._param_requires_grad_state[extra.bias] is False and len(model._param_requires_grad_state) == 4
    model.untoggle_optimizer(first)
    assert extra.weight.requires_grad and not extra.bias.requires_grad and model._param_requires_grad_state == {}
    with model.toggled_optimizer(second):
        assert not model.layer.weight.requires_grad and extra.weight.requires_grad
    assert model.layer.weight.requires_grad and model._param_requires_grad_state == {}


def test_configure_gradient_clipping_gets_the_trainers_algorithm_none_unless_given(tmp_path):
    """As Lightning: ``Trainer.gradient_clip_algorithm`` is None when not given (the default
    ``clip_gradients`` then clips by norm), and the hook gets exactly it."""
    seen = []

    class Model(BoringModel):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
            seen.append((gradient_clip_val, gradient_clip_algorithm, self.trainer.gradient_clip_algorithm))

    for given in (None, "value"):
        trainer = Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0, gradient_clip_val=1e-4,
                          gradient_clip_algorithm=given, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Model())
    assert seen == [(1e-4, None, None), (1e-4, "value", "value")]


def test_manual_step_hands_the_closure_and_kwargs_to_the_optimizer_and_returns_its_output(tmp_path):
    """Lightning's ``opt.step(closure=..., **kwargs)``: the user's optimizer's ``step`` gets both and
    what it returns comes back (an SGD returns the closure's loss)."""
    calls, returned = [], []

    class Recording(torch.optim.SGD):
        def step(self, closure=None, **kwargs):
            calls.append((closure is not None, kwargs))
            return super().step(closure)

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()

            def closure():
                loss = self.step(batch)
                self.manual_backward(loss)
                return loss

            returned.append(opt.step(closure=closure, tag=batch_idx))
            opt.zero_grad()

        def configure_optimizers(self):
            return Recording(self.parameters(), lr=0.1)

    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())
    assert calls == [(True, {"tag": 0}), (True, {"tag": 1})]
    assert all(torch.is_tensor(r) and r.requires_grad for r in returned)  # the closure's loss, via SGD.step


def test_training_step_with_optimizer_idx_is_refused_as_lightning(tmp_path):
    class Model(BoringModel):
        def training_step(self, batch, batch_idx, optimizer_idx):
            return super().training_step(batch, batch_idx)

    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"Remove the `optimizer_idx` argument from `training_step`"):
        trainer.fit(Model())


def test_on_save_checkpoint_sees_lightnings_lr_schedulers_key(tmp_path):
    """Lightning's hooks read ``checkpoint["lr_schedulers"]``: each scheduler's state, already
    stepped for the batch the checkpoint is saved after."""
    seen = []

    class Model(BoringModel):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), "interval": "step"}]

        def on_save_checkpoint(self, checkpoint):
            seen.append([(s["_step_count"], s["_last_lr"]) for s in checkpoint["lr_schedulers"]])

    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model())
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert seen == [[(3, [0.25])]]  # after 2 steps (the count starts at 1)


def test_lbfgs_re_evaluates_through_the_closure_as_a_plain_loop(tmp_path):
    """Automatic optimization hands the closure to the optimizer's ``step``: an LBFGS calls it
    again and again, each later call zeroing the gradients and running the batch's forward and
    backward once more, as Lightning's closure; the weights equal a plain PyTorch LBFGS loop."""
    from torch.utils.data import DataLoader, TensorDataset

    from zerotrain import TrainModule

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))

    def build():
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    class Model(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer, self.evaluations = build(), 0

        def training_step(self, batch, batch_idx):
            self.evaluations += 1
            x, y = batch
            return (self.layer(x) - y).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)

        def train_dataloader(self):
            return DataLoader(data, batch_size=4)

    model = Model()
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)

    layer = build()
    opt = torch.optim.LBFGS(layer.parameters(), lr=0.5, max_iter=5)
    evaluations = 0
    for x, y in DataLoader(data, batch_size=4):
        def closure():
            nonlocal evaluations
            evaluations += 1
            opt.zero_grad()
            loss = (layer(x) - y).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
    assert model.evaluations == evaluations > 2
    for ours, ref in zip(model.layer.parameters(), layer.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # tolerance: exact, the same ops in the same order


def test_a_trainer_with_its_optimizer_wrappers_pickles_after_fit(tmp_path):
    # the wrapper's class (LightningSGD) is made at run time; Lightning's progress-bar test pickles
    # the bar, which holds the Trainer, after fit
    import pickle

    trainer = Trainer(default_root_dir=tmp_path, max_steps=2, limit_val_batches=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = BoringModel()
    trainer.fit(model)
    assert type(model.optimizers()).__name__ == "LightningSGD"
    again = pickle.loads(pickle.dumps(trainer))
    opt = again.lightning_module.optimizers()
    assert type(opt).__name__ == "LightningSGD" and isinstance(opt, torch.optim.SGD)
    assert opt.param_groups[0]["lr"] == model.optimizers().param_groups[0]["lr"]
