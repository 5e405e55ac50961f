"""``configure_optimizers()`` read as Lightning 2.6 reads it (issue 41; upstream
trainer/optimization/test_optimizers.py): Lightning's two stages under its names, its
LRSchedulerConfig, warnings and refusals, compared with pytorch-lightning where it is installed."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn, optim

from zerotrain.core.optimizer import (_configure_optimizers, _configure_schedulers_automatic_opt,
                                      _configure_schedulers_manual_opt, _init_optimizers_and_lr_schedulers)
from zerotrain.demos.boring_classes import BoringModel
from zerotrain.utilities.exceptions import MisconfigurationException
from zerotrain.utilities.types import LRSchedulerConfig


def _pl_optimizer():
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.core import optimizer

    return optimizer


def _opts():
    model = nn.Linear(2, 2)
    return optim.Adam(model.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=0.1)


def _fields(config):
    return {k: getattr(config, k) for k in ("scheduler", "name", "interval", "frequency", "reduce_on_plateau",
                                            "monitor", "strict")}


def test_the_forms_split_as_lightnings():
    theirs = _pl_optimizer()
    a, b = _opts()
    sa, sb = optim.lr_scheduler.StepLR(a, 1), optim.lr_scheduler.StepLR(b, 1)
    forms = [a, [a, b], (a, b), ([a, b], [sa, sb]), ([a], sa), {"optimizer": a, "lr_scheduler": sa, "monitor": "m"},
             [{"optimizer": a, "lr_scheduler": {"scheduler": sa, "interval": "step"}, "monitor": "m"},
              {"optimizer": b}]]
    for form in forms:
        assert _configure_optimizers(form) == theirs._configure_optimizers(form), form


def test_schedulers_become_lightnings_configs():
    theirs = _pl_optimizer()
    a, _ = _opts()
    plateau = optim.lr_scheduler.ReduceLROnPlateau(a)
    step = optim.lr_scheduler.StepLR(a, 1)
    cases = [([step], None), ([plateau], "loss"), ([{"scheduler": step, "interval": "step", "frequency": 2,
                                                     "name": "s"}], None),
             ([{"scheduler": plateau, "monitor": "v", "strict": False}], None)]
    for schedulers, monitor in cases:
        ours = _configure_schedulers_automatic_opt(schedulers, monitor)
        assert [_fields(c) for c in ours] == [_fields(c) for c in
                                              theirs._configure_schedulers_automatic_opt(schedulers, monitor)]
    config = _configure_schedulers_automatic_opt([step], None)[0]
    assert config == LRSchedulerConfig(scheduler=step) and not config.reduce_on_plateau


def test_a_custom_plateau_scheduler_says_so():
    class Custom:
        pass

    config = _configure_schedulers_automatic_opt([{"reduce_on_plateau": True, "scheduler": Custom(),
                                                   "monitor": "m"}], None)[0]
    assert config.reduce_on_plateau and config.monitor == "m"


def test_lightnings_warnings_and_refusals():
    a, _ = _opts()
    one_cycle = optim.lr_scheduler.OneCycleLR(a, max_lr=0.01, total_steps=3)
    with pytest.warns(RuntimeWarning, match="Are you sure you didn't mean 'interval': 'step'?"):
        _configure_schedulers_automatic_opt([{"scheduler": one_cycle}], None)
    with pytest.warns(RuntimeWarning, match="Found unsupported keys in the lr scheduler dict: {'foo'}"):
        _configure_schedulers_automatic_opt([{"scheduler": one_cycle, "interval": "step", "foo": 1}], None)
    with pytest.raises(MisconfigurationException, match='must have the key "scheduler"'):
        _configure_schedulers_automatic_opt([{"interval": "step"}], None)
    with pytest.raises(MisconfigurationException, match='must be "step" or "epoch" but is "batch"'):
        _configure_schedulers_automatic_opt([{"scheduler": one_cycle, "interval": "batch"}], None)
    with pytest.raises(MisconfigurationException, match="lr scheduler dict must include a monitor"):
        _configure_schedulers_automatic_opt([{"scheduler": optim.lr_scheduler.ReduceLROnPlateau(a)}], None)
    with pytest.warns(RuntimeWarning, match=r"contains the key\(s\) \['monitor'\], but the keys will be ignored"):
        config = _configure_schedulers_manual_opt([{"scheduler": one_cycle, "monitor": "m"}])[0]
    assert config.monitor is None
    with pytest.raises(MisconfigurationException, match="Unknown configuration for model optimizers"):
        _configure_optimizers("adam")


def test_init_refuses_several_optimizers_under_automatic_optimization_with_lightnings_error():
    model = BoringModel()
    model.configure_optimizers = lambda: [optim.SGD(model.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=1)]
    with pytest.raises(RuntimeError, match="only supported with manual optimization"):
        _init_optimizers_and_lr_schedulers(model)
    model.automatic_optimization = False
    opts, configs = _init_optimizers_and_lr_schedulers(model)
    assert len(opts) == 2 and configs == []


def test_init_refuses_a_scheduler_outside_torchs_api_unless_the_module_steps_it():
    class Custom:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    model = BoringModel()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model.configure_optimizers = lambda: ([opt], [Custom(opt)])
    with pytest.raises(MisconfigurationException, match="doesn't follow PyTorch's LRScheduler API"):
        _init_optimizers_and_lr_schedulers(model)

    class Stepping(BoringModel):
        def lr_scheduler_step(self, scheduler, metric):
            pass

    model = Stepping()
    opt = optim.SGD(model.parameters(), lr=0.1)
    model.configure_optimizers = lambda: ([opt], [Custom(opt)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(_init_optimizers_and_lr_schedulers(model)[1]) == 1
    other = optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    model.configure_optimizers = lambda: ([opt], [optim.lr_scheduler.StepLR(other, 1)])
    with pytest.raises(MisconfigurationException, match="attached with an optimizer that wasn't returned"):
        _init_optimizers_and_lr_schedulers(model)
    assert torch.is_tensor(next(model.parameters()))
