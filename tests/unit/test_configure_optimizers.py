"""``configure_optimizers`` as Lightning 2.x reads it, several optimizers, and manual optimization on
one process, compared with pytorch-lightning 2.6 running the same module where it is cheap."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.strategies.optimizers import OptimizerSet
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.optim.optimization import MULTIPLE_AUTOMATIC, parse_optimizers


def _opts():
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    return torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)


def _sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


# ---------------------------------------------------------------------------- the forms
def test_a_list_is_several_optimizers_not_an_optimizer_and_a_scheduler():
    o1, o2 = _opts()
    opts, scheds = parse_optimizers([o1, o2])
    assert opts == [o1, o2] and scheds == []


def test_lists_of_optimizers_and_schedulers_default_to_per_epoch_as_lightning():
    o1, o2 = _opts()
    s1, s2 = _sched(o1), _sched(o2)
    opts, scheds = parse_optimizers(([o1, o2], [s1, {"scheduler": s2, "interval": "step"}]))
    assert opts == [o1, o2]
    assert [(c.scheduler, c.interval) for c in scheds] == [(s1, "epoch"), (s2, "step")]


def test_zerotrains_optimizer_scheduler_pair_keeps_stepping_per_step():
    o1, _ = _opts()
    s1 = _sched(o1)
    opts, scheds = parse_optimizers((o1, s1))
    assert opts == [o1] and [(c.scheduler, c.interval) for c in scheds] == [(s1, "step")]


def test_dicts_with_frequency_warn_as_lightning_and_ignore_it():
    o1, o2 = _opts()
    with pytest.warns(RuntimeWarning, match="Found unsupported keys in the optimizer configuration: {'frequency'}"):
        opts, scheds = parse_optimizers([{"optimizer": o1, "frequency": 2, "lr_scheduler": _sched(o1)},
                                         {"optimizer": o2, "frequency": 1}])
    assert opts == [o1, o2] and [c.interval for c in scheds] == ["epoch"]


def test_unknown_output_is_refused():
    with pytest.raises(ConfigError, match="configure_optimizers"):
        parse_optimizers("adam")


# ---------------------------------------------------------------------------- OptimizerSet
def test_optimizer_set_steps_only_the_selected_optimizer_and_round_trips_its_state():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(2, 1)
    o1, o2 = torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    s = OptimizerSet([o1, o2])
    assert [g is h for g, h in zip(s.param_groups, o1.param_groups + o2.param_groups)] == [True, True]
    b(a(torch.randn(4, 3))).sum().backward()
    before = b.weight.detach().clone()
    with s.selecting(0):
        s.step()
    assert torch.equal(b.weight, before) and len(s.state) == 2  # only Adam's two params have state
    s.step()
    sd = s.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3] and [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    o1b, o2b = torch.optim.Adam(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0, momentum=0.1)
    OptimizerSet([o1b, o2b]).load_state_dict(sd)
    assert o1b.param_groups[0]["lr"] == 0.1 and o2b.param_groups[0]["momentum"] == 0.9
    assert torch.equal(o2b.state[b.weight]["momentum_buffer"], o2.state[b.weight]["momentum_buffer"])


def test_optimizer_set_holds_a_parameter_in_two_optimizers_as_lightning():
    """Lightning allows it; the strategies that cannot step it from each refuse it
    (``test_conformance_optimizer_sharing.py``)."""
    a = nn.Linear(2, 2)
    s = OptimizerSet([torch.optim.SGD(a.parameters(), lr=1), torch.optim.SGD([a.bias], lr=1)])
    assert [(p is a.bias, ks) for p, ks in s.shared()] == [(True, [0, 1])]


def test_pipeline_refuses_several_optimizers():
    from zerotrain.strategies import strategy_from_name

    o1, o2 = _opts()
    with pytest.raises(ConfigError, match="pipeline.*2 optimizers"):
        strategy_from_name("pipeline").setup_optimizer(OptimizerSet([o1, o2]))


# ---------------------------------------------------------------------------- modules, both libraries
def _data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 6, generator=g) + 1.0, torch.randn(16, 4, generator=g))


def make_gan(base, automatic: bool = False, clip_val=None):
    """One class body for a LightningModule and a TrainModule: the port is the rename."""

    class Gan(base):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = automatic
            torch.manual_seed(0)
            self.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
            self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.record = []

        def training_step(self, batch, batch_idx):
            x, z = batch
            if automatic:
                return self.disc(x).pow(2).mean()
            d_opt, g_opt = self.optimizers()
            d_sched, g_sched = self.lr_schedulers()
            self.toggle_optimizer(d_opt)
            d_loss = (self.disc(x) - 1).pow(2).mean() + self.disc(self.gen(z).detach()).pow(2).mean()
            self.manual_backward(d_loss)
            self.clip_gradients(d_opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
            d_opt.step()
            d_opt.zero_grad()
            self.untoggle_optimizer(d_opt)
            self.toggle_optimizer(g_opt)
            g_loss = (self.disc(self.gen(z)) - 1).pow(2).mean()
            self.manual_backward(g_loss)
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)
            d_sched.step()
            if batch_idx % 2:
                g_sched.step()
            self.record.append((self.trainer.global_step, d_opt.param_groups[0]["lr"],
                                g_opt.param_groups[0]["lr"], float(d_loss.detach()), float(g_loss.detach())))

        def configure_optimizers(self):
            d_opt = torch.optim.Adam(self.disc.parameters(), lr=0.05)
            g_opt = torch.optim.SGD(self.gen.parameters(), lr=0.05, momentum=0.9)
            return [d_opt, g_opt], [torch.optim.lr_scheduler.StepLR(d_opt, 2, gamma=0.5),
                                    torch.optim.lr_scheduler.StepLR(g_opt, 1, gamma=0.9)]

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=4)

    return Gan()


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch, tmp_path):
    """Lightning sets this variable when it probes for CUDA, and writes into the working directory."""
    monkeypatch.chdir(tmp_path)


def _pl():
    return pytest.importorskip("pytorch_lightning")


def _pl_trainer(**kw):
    pl = _pl()
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _zt_trainer(**kw):
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)


def _fit_both(**kw):
    pl = _pl()
    ours, theirs = make_gan(TrainModule), make_gan(pl.LightningModule)
    t_ours, t_theirs = _zt_trainer(**kw), _pl_trainer(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_theirs.fit(theirs)
    t_ours.fit(ours)
    return (ours, t_ours), (theirs, t_theirs)


def test_manual_optimization_matches_lightning_steps_lr_and_weights():
    """global_step counts every optimizer step, LRs follow the user's scheduler steps, and the
    weights equal Lightning's after the same run (fp32, one process)."""
    (ours, t_ours), (theirs, t_theirs) = _fit_both(max_epochs=2)
    assert t_ours.global_step == t_theirs.global_step == 16
    assert [r[:3] for r in ours.record] == [r[:3] for r in theirs.record]
    # tolerance: exact: one process, the same modules, data, ops and order as Lightning's loop
    torch.testing.assert_close(torch.tensor([r[3:] for r in ours.record]),
                               torch.tensor([r[3:] for r in theirs.record]), rtol=0, atol=0)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=0, atol=0)  # tolerance: exact, as above


def test_max_steps_counts_optimizer_steps_as_lightning():
    (ours, t_ours), (theirs, t_theirs) = _fit_both(max_steps=6)
    assert t_ours.global_step == t_theirs.global_step == 6
    assert len(ours.record) == len(theirs.record) == 3


def test_several_optimizers_under_automatic_optimization_raise_as_lightning():
    pl = _pl()
    with pytest.raises(RuntimeError, match="only supported with manual optimization"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _pl_trainer(max_steps=1).fit(make_gan(pl.LightningModule, automatic=True))
    with pytest.raises(ConfigError) as info:
        _zt_trainer(max_steps=1).fit(make_gan(TrainModule, automatic=True))
    assert str(info.value) == MULTIPLE_AUTOMATIC


@pytest.mark.parametrize("kw, match", [({"gradient_clip_val": 1.0}, "Automatic gradient clipping"),
                                       ({"accumulate_grad_batches": 2}, "Automatic gradient accumulation")])
def test_manual_optimization_refuses_the_trainers_clipping_and_accumulation(kw, match):
    pl = _pl()
    with pytest.raises(Exception, match=match):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _pl_trainer(max_steps=1, **kw).fit(make_gan(pl.LightningModule))
    with pytest.raises(ConfigError, match=match):
        _zt_trainer(max_steps=1, **kw).fit(make_gan(TrainModule))


def test_manual_backward_calls_the_backward_hooks_per_call():
    calls = []

    class Hooked(type(make_gan(TrainModule))):
        def on_before_backward(self, loss):
            calls.append("before")

        def on_after_backward(self):
            calls.append("after")

        def on_before_optimizer_step(self, optimizer):
            calls.append(type(optimizer).__name__)

    _zt_trainer(max_steps=2).fit(Hooked())
    assert calls == ["before", "after", "Adam", "before", "after", "SGD"]


def test_pipeline_refuses_manual_optimization_at_set_up():
    from types import SimpleNamespace

    from zerotrain.strategies import strategy_from_name
    from zerotrain.trainer.optim.optimization import Optimization

    trainer = SimpleNamespace(gradient_clip_val=None, accumulate_grad_batches=1,
                              strategy=strategy_from_name("pipeline"))
    with pytest.raises(ConfigError, match="strategy='pipeline'.*automatic_optimization = False"):
        Optimization(trainer, make_gan(TrainModule))


def test_val_check_interval_counts_batches_in_manual_optimization_as_lightning():
    """Two optimizer steps per batch; validation every 2 batches, as Lightning counts them."""
    def with_validation(base):
        module = make_gan(base)
        seen = []

        def validation_step(batch, batch_idx):
            if batch_idx == 0:
                seen.append(module.trainer.global_step)

        module.validation_step, module.val_dataloader, module.seen = validation_step, module.train_dataloader, seen
        return module

    pl = _pl()
    theirs, ours = with_validation(pl.LightningModule), with_validation(TrainModule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _pl_trainer(max_epochs=1, val_check_interval=2, limit_val_batches=1).fit(theirs)
    _zt_trainer(max_epochs=1, val_check_interval=2, limit_val_batches=1).fit(ours)
    assert ours.seen == theirs.seen == [4, 8]
