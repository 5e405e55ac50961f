"""zerotrain.deepspeed without DeepSpeed, its config: every config key zerotrain implements is read
into the right object, unknown and no-effect keys are reported in one warning, unsupported values
are a ConfigError naming the key before anything trains, DeepSpeed's batch arithmetic and its
warm-up schedules' values. One process's engine loop and the rest of the API are in
test_deepspeed_engine.py; the 2-process comparison with DeepSpeed itself is
tests/distributed/test_deepspeed_compat.py."""
from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import zerotrain
import zerotrain.deepspeed as deepspeed
from zerotrain import ConfigError
from zerotrain.deepspeed import lr_schedules
from zerotrain.deepspeed.config import parse, report_ignored
from zerotrain.trainer.compat.deepspeed.ops.adam import DeepSpeedAdam, DeepSpeedAdamW

from deepspeed_unit_common import BASE, _own_group_and_checkpointing, cfg  # noqa: F401 - autouse fixture


# ---------------------------------------------------------------------------- the module paths
def test_deepspeed_module_paths_are_one_module_each():
    import zerotrain.deepspeed.comm as ds_comm
    from zerotrain.deepspeed import comm
    from zerotrain.deepspeed.accelerator import get_accelerator
    from zerotrain.deepspeed.checkpointing import checkpoint
    from zerotrain.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zerotrain.deepspeed.utils import RepeatingLoader, log_dist, logger

    assert comm is ds_comm is deepspeed.comm is zerotrain.trainer.compat.deepspeed.comm
    assert checkpoint is deepspeed.checkpointing.checkpoint and FusedAdam is deepspeed.ops.adam.FusedAdam
    assert DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam and logger is deepspeed.utils.logger
    assert (log_dist, RepeatingLoader) == (deepspeed.utils.log_dist, deepspeed.utils.RepeatingLoader)
    assert sys.modules["zerotrain.deepspeed"] is deepspeed is zerotrain.trainer.compat.deepspeed
    assert get_accelerator() is deepspeed.accelerator.get_accelerator()
    assert split is deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    for name in deepspeed.SUBMODULES:  # every module has one object, under either path
        assert sys.modules[f"zerotrain.deepspeed.{name}"] is sys.modules[f"zerotrain.trainer.compat.deepspeed.{name}"]
    code = "import sys, zerotrain.deepspeed; assert not [m for m in sys.modules if m.split('.')[0] == 'deepspeed']"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0  # DeepSpeed is never imported


def test_moe_split_passes_groups_through_and_accelerator_answers():
    p = nn.Parameter(torch.zeros(2))
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer({"params": iter([p]), "lr": 1})
    assert len(groups) == 1 and groups[0]["params"] == [p] and groups[0]["lr"] == 1
    acc = deepspeed.accelerator.Accelerator("cpu")
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name(), acc.communication_backend_name()) == \
        ("cpu", "cpu", "cpu", "gloo")
    acc.manual_seed_all(5)
    a = torch.rand(3)
    acc.manual_seed(5)
    assert torch.equal(a, torch.rand(3)) and acc.is_available()
    assert deepspeed.accelerator.Accelerator("cuda").device_name(1) == "cuda:1"
    assert deepspeed.comm.get_rank() == 0 and deepspeed.comm.get_world_size() == 1  # no group: a group of one


def test_add_config_arguments_and_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=nn.Linear(2, 1))
    assert isinstance(opt.optimizer, torch.optim.SGD) and loader is None and sched is None
    with pytest.raises(ConfigError, match="args.deepspeed_config=.* and config= both given"):
        deepspeed.initialize(args=args, model=nn.Linear(2, 1), config=BASE)
    with pytest.raises(ConfigError, match="config=None and no args.deepspeed_config"):
        deepspeed.initialize(model=nn.Linear(2, 1))


# ---------------------------------------------------------------------------- batch sizes
@pytest.mark.parametrize("given, world, want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
    ({"train_batch_size": 16}, 2, (16, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
])
def test_batch_sizes_follow_deepspeeds_arithmetic(given, world, want):
    c = parse(given, world)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == want


@pytest.mark.parametrize("given, world, match", [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     r"train_batch_size=30: not train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps \(2\) x world"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 2, "train_batch_size=10: not"),
    ({"train_batch_size": 1}, 2, "train_batch_size=1: not"),
    ({"gradient_accumulation_steps": 2}, 1, "neither is given"),
    ({"train_micro_batch_size_per_gpu": 0}, 1, r"train_micro_batch_size_per_gpu=0: too small; valid: an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": 2.5}, 1, "not a whole number"),
])
def test_inconsistent_batch_sizes_are_errors(given, world, match):
    with pytest.raises(ConfigError, match=match):
        parse(given, world)


# ---------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("section, cls, kwargs", [
    ({"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}, torch.optim.AdamW, {"lr": 0.1}),
    # without torch_adam: DeepSpeed's FusedAdam, torch's Adam(W) stepping bf16 parameters by its kernel
    ({"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False, "weight_decay": 0.1}}, DeepSpeedAdam,
     {"lr": 0.1, "weight_decay": 0.1}),
    # without torch_adam DeepSpeed steps FusedAdam, whose weight_decay defaults to 0 (not AdamW's 0.01)
    ({"type": "adamw", "params": {"lr": 0.1, "adam_w_mode": False}}, DeepSpeedAdamW,
     {"lr": 0.1, "weight_decay": 0.0}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ({"type": "Adagrad", "params": {"lr": 0.1}}, torch.optim.Adagrad, {"lr": 0.1}),
])
def test_optimizer_section(section, cls, kwargs):
    spec = cfg(optimizer=section).optimizer
    assert spec.cls is cls and spec.kwargs == kwargs
    assert type(spec.build([nn.Parameter(torch.zeros(1))])) is cls


@pytest.mark.parametrize("section, match", [
    ({"type": "Lamb", "params": {}}, "optimizer.type='Lamb': a DeepSpeed kernel optimizer"),
    ({"type": "Nope"}, "optimizer.type='Nope': not an optimizer"),
    ({"params": {"lr": 1}}, "optimizer.type=None: missing"),
    ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, "max_grad_norm=1.0: not an optimizer parameter; "
                                                          "valid: the top-level \"gradient_clipping\""),
    ({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}, "optimizer.params=.*SGD rejects them"),
    ({"type": "Adam", "params": {"bias_correction": False}}, "bias_correction=False: not supported"),
])
def test_unsupported_optimizer_values_are_errors(section, match):
    with pytest.raises(ConfigError, match=match):
        cfg(optimizer=section)


def test_untested_optimizer_under_zero_needs_the_flag():
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="optimizer.type=SGD: an optimizer DeepSpeed does not test under ZeRO "
                                          r"\(zero_optimization.stage=2\); valid: .*zero_allow_untested_optimizer"):
        cfg(optimizer=sgd, zero_optimization={"stage": 2})
    assert cfg(optimizer=sgd, zero_optimization={"stage": 2}, zero_allow_untested_optimizer=True).optimizer
    assert cfg(optimizer=sgd).optimizer  # no ZeRO: any optimizer
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="optimizer=SGD: an optimizer DeepSpeed does not test under ZeRO"):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config={**BASE, "zero_optimization": {"stage": 1}})


# ---------------------------------------------------------------------------- scheduler
def test_scheduler_sections_and_their_values():
    c = cfg(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 4}})
    assert c.scheduler.cls is lr_schedules.WarmupDecayLR and c.scheduler.kwargs["total_num_steps"] == 10
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    # WarmupLR (linear): min + (max - min) * i / N; the rate of step 0 is set when it is built
    s = lr_schedules.WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear")
    seen = [opt.param_groups[0]["lr"]]
    for _ in range(6):
        s.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.01])
    # log warm-up: log(i + 1) / log(N); then WarmupDecayLR falls linearly to 0 at total_num_steps
    d = lr_schedules.WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4)
    d.step(2)
    assert opt.param_groups[0]["lr"] == pytest.approx(math.log(3) / math.log(4))
    d.step(7)
    assert opt.param_groups[0]["lr"] == pytest.approx(3 / 6)
    assert d.state_dict() == {"last_batch_iteration": 7}
    # WarmupCosineLR scales the group's lr: min ratio -> 1, then cosine to cos_min_ratio
    opt.param_groups[0]["lr"] = 0.1
    c = lr_schedules.WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_min_ratio=0.5,
                                    warmup_type="linear", cos_min_ratio=0.0)
    assert opt.param_groups[0]["lr"] == 0.0  # before its first step, as DeepSpeed's
    c.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.75)
    c.step(5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (1 + math.cos(math.pi * 4 / 8)) / 2)


@pytest.mark.parametrize("section, match", [
    ({"type": "CyclicLR", "params": {}}, "scheduler.type='CyclicLR': not a supported scheduler; valid: WarmupLR, "
                                         "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, "warmup_type='cubic': unknown; valid: log, linear"),
    ({"type": "WarmupDecayLR", "params": {}}, "WarmupDecayLR rejects them"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "warmup_num_steps=0"),
])
def test_unsupported_scheduler_values_are_errors(section, match):
    with pytest.raises(ConfigError, match=match):
        cfg(scheduler=section)


# ---------------------------------------------------------------------------- precision
def test_fp16_and_bf16_sections():
    c = cfg(fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "hysteresis": 3,
                  "min_loss_scale": 2, "loss_scale": 0})
    assert c.precision == "16-mixed" and c.fp16_enabled
    scaler = c.make_precision().scaler
    assert (scaler.init_scale, scaler.growth_interval, scaler.hysteresis, scaler.min_scale) == (256.0, 50, 3, 2.0)
    assert cfg(bf16={"enabled": True}).make_precision().name == "bf16-mixed"
    assert cfg(bfloat16={"enabled": True}).bf16_enabled
    assert cfg(fp16={"enabled": False}, bf16={"enabled": False}).precision == "32"


@pytest.mark.parametrize("keys, match", [
    ({"fp16": {"enabled": True, "loss_scale": 128}}, r"fp16.loss_scale=128: a static loss scale is not supported; "
                                                     r"valid: 0 \(dynamic loss scaling\)"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis=True"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both; valid: at most one"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled='yes': not a boolean"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale=0: out of range"),
])
def test_unsupported_precision_values_are_errors(keys, match):
    with pytest.raises(ConfigError, match=match):
        cfg(**keys)


# ---------------------------------------------------------------------------- zero_optimization
def test_zero_stages_map_to_strategies():
    assert (cfg(1).strategy, cfg(2).strategy) == ("single", "ddp")  # stage 0
    for stage, name in ((1, "zero1"), (2, "zero2"), (3, "zero3")):
        c = cfg(zero_optimization={"stage": stage})
        assert (c.strategy, c.zero_stage, c.make_strategy().name) == (name, stage, name)


def test_zero_keys_become_strategy_options():
    s = cfg(zero_optimization={"stage": 2, "reduce_bucket_size": 5e4, "allgather_bucket_size": 3e4,
                               "overlap_comm": False}).make_strategy()
    assert (s.spec.buckets.reduce_bucket_size, s.spec.buckets.allgather_bucket_size, s.spec.zero.overlap_comm) == \
        (50000, 30000, False)
    s = cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 100, "stage3_max_live_parameters": 1000,
                               "stage3_param_persistence_threshold": 10, "stage3_max_reuse_distance": 500}).make_strategy()
    st = s.spec.stage3
    assert (st.prefetch_bucket_size, st.max_live_parameters, st.param_persistence_threshold) == (100, 1000, 10)
    assert st.max_reuse_distance == 500
    s = cfg(zero_optimization={"stage": 3, "zero_quantized_weights": True,
                               "zero_quantized_gradients": True}).make_strategy()
    assert s.spec.stage3.quantize_weights and s.spec.zero.quantize_gradients
    s = cfg(zero_optimization={"stage": 2, "zero_quantized_gradients": True}).make_strategy()
    assert s.spec.zero.quantize_gradients


def test_hpz_partition_size_maps_to_the_node_wide_secondary_partition(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cfg(zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}).make_strategy().spec.stage3.hierarchical_partition
    assert not cfg(zero_optimization={"stage": 3, "zero_hpz_partition_size": 1}).make_strategy().spec.stage3.hierarchical_partition
    assert cfg(zero_optimization={"stage": 2, "zero_hpz_partition_size": 1}).make_strategy()  # 1 is off anywhere
    for zero, expected in (({"stage": 3, "zero_hpz_partition_size": 4}, "spans one node (2 ranks); valid: 1 (off) or 2"),
                           ({"stage": 2, "zero_hpz_partition_size": 2}, "stage 3's parameters (stage=2)"),
                           ({"stage": 3, "zero_hpz_partition_size": 0}, "too small")):
        with pytest.raises(ConfigError, match="zero_hpz_partition_size") as info:
            cfg(zero_optimization=zero).make_strategy()
        assert expected in str(info.value), str(info.value)


def test_offload_sections(tmp_path):
    c = cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                               "sub_group_size": 1000})
    s = c.make_strategy()
    assert c.strategy == "offload" and (s.offload.optimizer_device, s.offload.param_device) == ("cpu", "none")
    assert (s.offload.pin_memory, s.offload.sub_group_size) == (False, 1000)
    c = cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                               "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5}})
    s = c.make_strategy()
    assert (s.offload.optimizer_device, s.offload.param_device, s.offload.nvme_path, s.offload.buffer_count) == \
        ("nvme", "nvme", str(tmp_path), 5)
    assert cfg(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}).strategy_options["stage"] == 2


@pytest.mark.parametrize("zero, match", [
    ({"stage": 4}, r"^zero_optimization.stage=4: not a ZeRO stage; valid: 0, 1, 2, 3$"),
    ({"stage": True}, "zero_optimization.stage=True"),
    ({"stage": 2, "reduce_bucket_size": 0}, "zero_optimization.reduce_bucket_size=0: too small"),
    ({"stage": 2, "overlap_comm": "yes"}, "zero_optimization.overlap_comm='yes': not a boolean"),
    ({"stage": 3, "stage3_max_live_parameters": -1}, "stage3_max_live_parameters=-1: too small"),
    ({"stage": 2, "offload_optimizer": {"device": "disk"}}, "offload_optimizer.device='disk': not an offload "
                                                           "device; valid: none, cpu, nvme"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "offload_optimizer.nvme_path=None: missing"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
     "offload_param.device='cpu': parameter offload needs stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "optimizer offload needs ZeRO"),
    ({"stage": 3, "offload_param": {"device": "cpu"}}, "also set zero_optimization.offload_optimizer.device"),
])
def test_unsupported_zero_values_are_errors(zero, match):
    with pytest.raises(ConfigError, match=match):
        cfg(zero_optimization=zero)


# ---------------------------------------------------------------------------- the rest, and the report
def test_monitoring_and_clipping_keys(tmp_path):
    c = cfg(gradient_clipping=1.5, steps_per_print=7, wall_clock_breakdown=True, dataloader_drop_last=True,
            tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "run"})
    assert (c.gradient_clipping, c.steps_per_print, c.wall_clock_breakdown, c.dataloader_drop_last) == \
        (1.5, 7, True, True)
    assert c.tensorboard_dir == str(tmp_path / "run")
    assert cfg(tensorboard={"enabled": False}).tensorboard_dir is None
    with pytest.raises(ConfigError, match="gradient_clipping=-1: not a number >= 0"):
        cfg(gradient_clipping=-1)
    with pytest.raises(ConfigError, match="steps_per_print=0: too small"):
        cfg(steps_per_print=0)


def test_ignored_keys_are_reported_once(caplog):
    c = cfg(flops_profiler={"enabled": True}, comms_logger={"enabled": True, "debug": True, "prof_all": False},
            fp16={"enabled": False, "auto_cast": False},
            zero_optimization={"stage": 2, "contiguous_gradients": True, "magic": 1},
            optimizer={"type": "Adam", "params": {"lr": 0.1}, "extra": 1})
    assert c.comms_logger and not c.comms_verbose
    assert sorted(c.ignored) == sorted([
        "flops_profiler (not implemented)", "comms_logger.debug (no effect in zerotrain)",
        "comms_logger.prof_all=false (every collective is recorded)",
        "fp16.auto_cast (no effect in zerotrain)", "zero_optimization.contiguous_gradients (no effect in zerotrain)",
        "zero_optimization.magic (not implemented)", "optimizer.extra (not implemented)"])
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        report_ignored(c)
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "7 config key(s) ignored" in warnings[0] and "flops_profiler" in warnings[0]
    assert not cfg().ignored


def test_an_unsupported_value_fails_before_anything_is_built():
    model = nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=4: not a ZeRO stage; valid: 0, 1, 2, 3"):
        deepspeed.initialize(model=model, config={**BASE, "optimizer": {"type": "Adam"},
                                                  "zero_optimization": {"stage": 4}})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
