"""``deepspeed.initialize(..., mpu=...)`` with ALST's mpu, before any process group (issue 45): the
config read for data x sequence (DeepSpeed 0.19.8's batch arithmetic over world / sp ranks, the
strategy's ``sequence_parallel``), ``sequence_parallel_size`` checked against the mpu, and what is
not supported refused with one line. Training against DeepSpeed: tests/distributed/test_deepspeed_alst.py."""
from __future__ import annotations

import types

import pytest
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain import ConfigError
from zerotrain.deepspeed.config import parse
from zerotrain.trainer.compat.deepspeed.autotp import sequence_parallel_of


def _raw(stage: int, **extra) -> dict:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **extra}


@pytest.mark.parametrize("stage,name", [(0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "zero3")])
def test_mpu_puts_the_sequence_axis_on_the_strategy(stage, name):
    cfg = parse(_raw(stage, sequence_parallel_size=2), 8, 2)
    assert (cfg.strategy, cfg.strategy_options["sequence_parallel"]) == (name, 2)
    # DeepSpeed's world_size and batch arithmetic count data-parallel ranks: 8 / 2
    assert (cfg.world_size, cfg.gradient_accumulation_steps) == (4, 1)
    assert not any(key.startswith("sequence_parallel_size") for key in cfg.ignored)
    assert cfg.make_strategy().parallel_sizes["sequence"] == 2


def test_two_ranks_one_sequence_group_is_ddp_not_single():
    cfg = parse(_raw(0, train_batch_size=1), 2, 2)
    assert (cfg.strategy, cfg.world_size, cfg.strategy_options) == ("ddp", 1, {"sequence_parallel": 2})


def test_sequence_parallel_size_must_agree_with_the_mpu():
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size=4: the mpu's sequence-parallel size is 2; valid"):
        parse(_raw(1, sequence_parallel_size=4), 8, 2)
    with pytest.raises(ConfigError, match=r"^sequence_parallel_size=2: initialize got no sequence-parallel mpu; "
                                          r"valid: 1, or pass ALST's mpu"):
        parse(_raw(1, sequence_parallel_size=2), 4)


def test_offload_and_autotp_with_the_mpu_are_refused():
    offload = _raw(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"^initialize\(mpu=...\)='sequence_parallel_size 2': .*strategy offload"):
        parse(offload, 4, 2)
    with pytest.raises(ConfigError, match=r"without offload or AutoTP"):
        parse(_raw(1, tensor_parallel={"autotp_size": 2}), 4, 2)


def test_other_mpus_are_refused_in_one_line():
    assert sequence_parallel_of(None) == 1
    megatron = types.SimpleNamespace(get_model_parallel_world_size=lambda: 2, get_data_parallel_group=lambda: None)
    with pytest.raises(ConfigError, match=r"^initialize: mpu=SimpleNamespace; valid: None, or ALST's mpu "):
        sequence_parallel_of(megatron)
    with pytest.raises(ConfigError, match=r"^initialize: mesh_param=\(1, 2\); valid: None"):
        deepspeed.initialize(model=nn.Linear(2, 2), config=_raw(0), mesh_param=(1, 2))
