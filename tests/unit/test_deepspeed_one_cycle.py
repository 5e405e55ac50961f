"""DeepSpeed's ``OneCycle`` and ``LRRangeTest`` schedules (its "one-cycle" and "lrrt" tutorials),
through the config's ``scheduler.type`` and at DeepSpeed's own path ``deepspeed.runtime.lr_schedules``
(found porting DeepSpeed's tests/unit/runtime/test_lr_schedulers.py, issue 42: both names were a
ConfigError and the path did not exist). Compared, rate by rate and beta by beta, with DeepSpeed's
own classes where DeepSpeed is installed; a few points by hand otherwise."""
from __future__ import annotations

import pytest
import torch

from zerotrain.deepspeed.config import parse
from zerotrain.deepspeed.runtime import lr_schedules as ours

CASES = [
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 7, "decay_lr_rate": 0.3,
                  "decay_step_size": 3, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 6, "cycle_second_step_size": 4,
                  "cycle_first_stair_count": 3, "cycle_second_stair_count": 2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]


def _trace(cls, params, steps=30):
    opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=1.0)
    sched = cls(opt, **params)
    seen = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])]
    for _ in range(steps):
        sched.step()
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"], sched.get_last_lr()))
    return seen


@pytest.mark.parametrize("name,params", CASES)
def test_rates_and_betas_are_deepspeeds(name, params):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import lr_schedules as theirs

    assert _trace(getattr(ours, name), params) == _trace(getattr(theirs, name), params)


def test_one_cycle_by_hand_and_from_the_config():
    cfg = parse({"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1.0}},
                 "scheduler": {"type": ours.ONE_CYCLE, "params": {ours.CYCLE_MIN_LR: 0.1, ours.CYCLE_MAX_LR: 0.5,
                                                                  ours.CYCLE_FIRST_STEP_SIZE: 4}}}, world_size=1)
    opt = cfg.optimizer.build([torch.zeros(1, requires_grad=True)])
    sched = cfg.scheduler.build(opt)
    assert isinstance(sched, ours.OneCycle)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    lrs = []
    for _ in range(10):
        sched.step()
        lrs.append(round(opt.param_groups[0]["lr"], 10))
    assert lrs == [0.2, 0.3, 0.4, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]  # up 4, down 4, then min (no decay)
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)  # after the cycle: cycle_max_mom


def test_lr_range_test_by_hand():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = ours.LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=2, lr_range_test_staircase=True)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.01, 0.01, 0.02, 0.02, 0.03]  # k = floor(steps taken / 2), steps counted from 1
