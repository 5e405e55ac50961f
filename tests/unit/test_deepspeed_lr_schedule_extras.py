"""DeepSpeed 0.19.8's schedule classes as scripts use them directly: a tensor ``lr`` kept and
written in place, WarmupCosineLR's ``get_lr_ratio()``, OneCycle's ``step_ratio``, and an unknown
``warmup_type`` warned about and replaced by "log" (the config still refuses it). Found running
DeepSpeed's tests/unit/runtime/test_lr_schedulers.py renamed (issue 42): 15 of its 82 cases failed."""
from __future__ import annotations

import logging

import pytest
import torch

from zerotrain import ConfigError
from zerotrain.deepspeed.config import parse
from zerotrain.deepspeed.runtime import lr_schedules as lrs

pytestmark = pytest.mark.timeout(120)

SCHEDULES = [
    (lrs.WarmupLR, dict(warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=5)),
    (lrs.WarmupDecayLR, dict(total_num_steps=20, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=5)),
    (lrs.WarmupCosineLR, dict(total_num_steps=20, warmup_num_steps=5)),
    (lrs.LRRangeTest, dict(lr_range_test_min_lr=0.01, lr_range_test_step_size=3)),
    (lrs.OneCycle, dict(cycle_min_lr=0.01, cycle_max_lr=0.2, cycle_first_step_size=4)),
]


def _sgd(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


@pytest.mark.parametrize("shape", [(), (1,)])
@pytest.mark.parametrize("cls, kwargs", SCHEDULES, ids=[c.__name__ for c, _ in SCHEDULES])
def test_a_tensor_lr_is_written_in_place(cls, kwargs, shape):
    lr = torch.full(shape, 0.3, dtype=torch.float64)
    opt, twin = _sgd(lr), _sgd(0.3)
    sched, twin_sched = cls(opt, **kwargs), cls(twin, **kwargs)
    for step in range(8):
        assert opt.param_groups[0]["lr"] is lr and lr.shape == shape
        # exact: the same Python arithmetic, its float stored into a float64 tensor
        assert lr.item() == twin.param_groups[0]["lr"], step
        sched.step()
        twin_sched.step()


def test_warmup_cosine_ratio_is_what_each_group_is_scaled_by():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.5},
                           {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.25}])
    sched = lrs.WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=4)
    assert sched.get_lr_ratio() == 0.0
    for _ in range(12):
        sched.step()
        r = sched.get_lr_ratio()
        assert 0 <= r <= 1
        assert [g["lr"] for g in opt.param_groups] == [0.5 * r, 0.25 * r]


def test_unknown_warmup_type_warns_and_warms_up_as_log(caplog):
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        odd = lrs.WarmupLR(_sgd(0.1), warmup_num_steps=6, warmup_type="cubic")
    assert odd.warmup_type == "log" and "warmup_type='cubic'" in caplog.text
    ref = lrs.WarmupLR(_sgd(0.1), warmup_num_steps=6, warmup_type="log")
    for _ in range(8):
        odd.step()
        ref.step()
        assert odd.get_last_lr() == ref.get_last_lr()
    with pytest.raises(ConfigError, match="warmup_type='cubic': unknown"):  # the config still refuses it
        parse({"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupCosineLR",
                                                                   "params": {"warmup_type": "cubic"}}}, 1)


@pytest.mark.parametrize("second, ratio", [(None, 0.5), (12, 0.25), (0, 1.0)])
def test_one_cycle_step_ratio_is_the_rising_share(second, ratio):
    opt = _sgd(0.1)
    sched = lrs.OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                         cycle_second_step_size=second, cycle_momentum=False)
    assert sched.step_ratio == ratio
    assert opt.param_groups[0]["lr"] == 0.01
    sched.step()
    assert opt.param_groups[0]["lr"] > 0.01
