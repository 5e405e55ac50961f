"""zerotrain.deepspeed without DeepSpeed: every config key zerotrain implements is read into the
right object, unknown and no-effect keys are reported in one warning, unsupported values are a
ConfigError naming the key before anything trains, DeepSpeed's batch arithmetic, its warm-up
schedules' values, and one process's engine loop against the plain PyTorch loop it stands for
(the 2-process comparison with DeepSpeed itself is tests/distributed/test_deepspeed_compat.py)."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zerotrain
import zerotrain.deepspeed as deepspeed
from zerotrain import ConfigError
from zerotrain.deepspeed import checkpointing, lr_schedules
from zerotrain.deepspeed.config import ActivationCheckpointing, parse, report_ignored

BASE = {"train_micro_batch_size_per_gpu": 2}


@pytest.fixture(autouse=True)
def _own_group_and_checkpointing(monkeypatch):
    """``initialize`` makes a process group of one here (as DeepSpeed does for a process started
    without a launcher): each test lets go of the group it made. ``checkpointing.configure`` sets
    module-wide options: each test gets them back as they were."""
    monkeypatch.setattr(checkpointing, "_settings", checkpointing._settings)
    monkeypatch.setattr(checkpointing, "_configured", checkpointing._configured)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def cfg(world: int = 1, **keys):
    return parse({**BASE, **keys}, world)


# ---------------------------------------------------------------------------- the module paths
def test_deepspeed_module_paths_are_one_module_each():
    import zerotrain.deepspeed.comm as ds_comm
    from zerotrain.deepspeed import comm
    from zerotrain.deepspeed.accelerator import get_accelerator
    from zerotrain.deepspeed.checkpointing import checkpoint
    from zerotrain.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from zerotrain.deepspeed.utils import RepeatingLoader, log_dist, logger

    assert comm is ds_comm is deepspeed.comm is zerotrain.trainer.deepspeed.comm
    assert checkpoint is deepspeed.checkpointing.checkpoint and FusedAdam is deepspeed.ops.adam.FusedAdam
    assert DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam and logger is deepspeed.utils.logger
    assert (log_dist, RepeatingLoader) == (deepspeed.utils.log_dist, deepspeed.utils.RepeatingLoader)
    assert sys.modules["zerotrain.deepspeed"] is deepspeed is zerotrain.trainer.deepspeed
    assert get_accelerator() is deepspeed.accelerator.get_accelerator()
    assert split is deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer
    for name in deepspeed.SUBMODULES:  # every module has one object, under either path
        assert sys.modules[f"zerotrain.deepspeed.{name}"] is sys.modules[f"zerotrain.trainer.deepspeed.{name}"]
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
    ({"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False, "weight_decay": 0.1}}, torch.optim.Adam,
     {"lr": 0.1, "weight_decay": 0.1}),
    ({"type": "adamw", "params": {"lr": 0.1, "adam_w_mode": False}}, torch.optim.AdamW, {"lr": 0.1}),
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
    ({"type": "OneCycle", "params": {}}, "scheduler.type='OneCycle': not a supported scheduler; valid: WarmupLR, "
                                         "WarmupDecayLR, WarmupCosineLR"),
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


# ---------------------------------------------------------------------------- one process's loop
def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


GAS, CLIP = 3, 0.05
LOOP_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
               "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.1}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.05}}}


def _plain_loop() -> tuple[nn.Module, list[float], list[float]]:
    """What DeepSpeed's engine does, in plain PyTorch: loss / GAS, step and schedule every GAS
    micro-batches, clipping, AdamW (DeepSpeed's "Adam"), the DistributedSampler's order."""
    model, data = _net(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = lr_schedules.WarmupLR(opt, warmup_num_steps=3, warmup_max_lr=0.05)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    losses, lrs = [], []
    for i, (x, y) in enumerate(loader):
        loss = F.mse_loss(model(x), y)
        (loss / GAS).backward()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return model, losses, lrs


@pytest.mark.parametrize("backward", ["engine.backward", "loss.backward"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_one_process_engine_loop_equals_the_plain_loop(stage, backward):
    """Either backward DeepSpeed 0.19 accepts: ``engine.backward(loss)``, or a plain
    ``loss.backward()`` whose gradients the engine divides by the accumulation count."""
    model = _net()
    engine, opt, loader, sched = deepspeed.initialize(model=model, training_data=_data(),
                                                      config={**LOOP_CONFIG, "zero_optimization": {"stage": stage}})
    losses, lrs, boundaries = [], [], []
    for x, y in loader:
        loss = F.mse_loss(engine(x), y)
        if backward == "loss.backward":
            loss.backward()
        else:
            assert engine.backward(loss).item() == pytest.approx(loss.item() / GAS)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        losses.append(loss.item())
        if boundaries[-1]:
            lrs.append(engine.get_lr()[0])
    ref, want_losses, want_lrs = _plain_loop()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert lrs == pytest.approx(want_lrs, rel=1e-12)
    assert boundaries == [False, False, True] * 4
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (4, 12, 24)
    assert isinstance(sched, lr_schedules.WarmupLR) and isinstance(loader.sampler, DistributedSampler)
    full = engine.zerotrain_engine.strategy.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    assert (engine.zero_optimization_stage(), engine.zero_optimization(), engine.train_batch_size()) == \
        (stage, stage > 0, 6)


def test_monitoring_writes_tensorboard_events_and_prints_progress(tmp_path, caplog):
    model = _net()
    config = {**LOOP_CONFIG, "steps_per_print": 2, "wall_clock_breakdown": True,
              "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}}
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=_data(), config=config)
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        for x, y in loader:
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    engine.destroy()
    assert list((tmp_path / "job").glob("events.out.tfevents.*"))
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("step=") for m in messages) == 2 and sum(m.startswith("time (ms)") for m in messages) == 2


def test_deprecated_cpu_offload_flags_mean_cpu_offload():
    c = cfg(zero_optimization={"stage": 3, "cpu_offload": True, "cpu_offload_param": True})
    assert c.strategy == "offload" and (c.strategy_options["optimizer_device"], c.strategy_options["param_device"]) \
        == ("cpu", "cpu")
    assert cfg(zero_optimization={"stage": 2, "cpu_offload": False}).strategy == "zero2"


# ---------------------------------------------------------------------------- zero.Init, GatheredParameters
ZERO3 = {**LOOP_CONFIG, "zero_optimization": {"stage": 3}}


def test_zero_init_builds_the_model_the_engine_trains_and_gathered_parameters_write_back():
    from zerotrain.strategies.zero.unit import is_placeholder

    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    assert all(is_placeholder(p) for p in model.parameters())  # partitioned as built
    with pytest.raises(ConfigError, match="GatheredParameters: these parameters were built under zero.Init and are "
                                          "not set up yet"):
        deepspeed.zero.GatheredParameters(model[0].bias).__enter__()
    engine, *_ = deepspeed.initialize(model=model, config=ZERO3)
    want = _net().state_dict()  # the same seed, built eagerly
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach(), want[name])
    with deepspeed.zero.GatheredParameters(engine.module[0].bias, modifier_rank=0):
        with torch.no_grad():
            engine.module[0].bias.fill_(3.0)
    assert is_placeholder(engine.module[0].bias)  # partitioned again after the block
    assert torch.equal(engine.zerotrain_engine.strategy.full_state_dict()["0.bias"], torch.full((8,), 3.0))


@pytest.mark.parametrize("config, match", [
    ({**BASE, "zero_optimization": {"stage": 2}}, "zero.Init: zero_optimization.stage=2: Init partitions parameters, "
                                                  "which only stage 3 trains; valid: 3"),
])
def test_zero_init_needs_stage_3(config, match):
    with pytest.raises(ConfigError, match=match):
        with deepspeed.zero.Init(config_dict_or_path=config):
            pass


def test_initialize_after_zero_init_needs_the_same_zero3_options():
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = _net()
    other = {**LOOP_CONFIG, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10}}
    with pytest.raises(ConfigError, match="the model was built under zero.Init with other ZeRO-3 options"):
        deepspeed.initialize(model=model, config=other)


def test_checkpoint_tags_latest_and_client_state(tmp_path):
    model = _net()
    engine, *_ = deepspeed.initialize(model=model, config={**LOOP_CONFIG, "zero_optimization": {"stage": 2}})
    assert engine.load_checkpoint(tmp_path) == (None, None)  # no `latest` yet: nothing loaded, as DeepSpeed
    engine.save_checkpoint(tmp_path, tag="a", client_state={"epoch": 3})
    engine.save_checkpoint(tmp_path, tag="b", client_state={"epoch": 4}, save_latest=False)
    assert (tmp_path / "latest").read_text().strip() == "a"
    assert engine.load_checkpoint(tmp_path) == (str(tmp_path / "a"), {"epoch": 3})
    assert engine.load_checkpoint(tmp_path, tag="b") == (str(tmp_path / "b"), {"epoch": 4})
    with pytest.raises(ConfigError, match="load_checkpoint: load_optimizer_states=False; valid: True"):
        engine.load_checkpoint(tmp_path, load_optimizer_states=False)


# ---------------------------------------------------------------------------- deepspeed.checkpointing
def test_activation_checkpointing_section_and_configure(tmp_path):
    c = cfg(activation_checkpointing={"partition_activations": True, "cpu_checkpointing": True,
                                      "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                      "synchronize_checkpoint_boundary": True, "profile": True, "extra": 1})
    assert c.activation_checkpointing == ActivationCheckpointing(True, True, True, 4, True, True)
    assert c.ignored == ("activation_checkpointing.extra (not implemented)",)
    assert cfg().activation_checkpointing is None
    # initialize checks the section but, like DeepSpeed 0.19.8's, does not apply it: configure does
    deepspeed.initialize(model=nn.Linear(2, 1), config={**LOOP_CONFIG, "activation_checkpointing": {"profile": True}})
    assert not checkpointing.is_configured() and checkpointing.settings() == ActivationCheckpointing()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}))
    checkpointing.configure(None, deepspeed_config=str(path), profile=False, synchronize=True)
    assert checkpointing.is_configured()
    assert checkpointing.settings() == ActivationCheckpointing(cpu_checkpointing=True,
                                                               synchronize_checkpoint_boundary=True)
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    assert checkpointing.settings() == ActivationCheckpointing(True, True, False, 2)  # each call starts from defaults
    one = type("MPU", (), {"get_model_parallel_world_size": lambda self: 1})()
    checkpointing.configure(one, checkpoint_in_cpu=True)
    assert checkpointing.settings().cpu_checkpointing


@pytest.mark.parametrize("section, match", [
    ({"cpu_checkpointing": "yes"},
     r"activation_checkpointing.cpu_checkpointing='yes': not a boolean; valid: true or false"),
    ({"number_checkpoints": 0}, r"activation_checkpointing.number_checkpoints=0: too small; valid: an integer >= 1"),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 2},
     r"contiguous_memory_optimization=True: contiguous buffers hold partitioned activations only .*valid: false, "
     "or partition_activations true"),
    ({"contiguous_memory_optimization": True, "partition_activations": True},
     r"activation_checkpointing.number_checkpoints=None: contiguous_memory_optimization sizes its buffers"),
    ("on", r"activation_checkpointing='on': not a JSON object"),
])
def test_unsupported_activation_checkpointing_values_are_errors(section, match):
    with pytest.raises(ConfigError, match=match):
        cfg(activation_checkpointing=section)
    with pytest.raises(ConfigError, match=match):
        checkpointing.configure(None, deepspeed_config={**BASE, "activation_checkpointing": section})


def test_configure_refuses_model_parallelism_and_bad_arguments():
    two = type("MPU", (), {"get_tensor_model_parallel_world_size": lambda self: 2})()
    with pytest.raises(ConfigError, match=r"mpu_ with model-parallel size 2; valid: None or size 1"):
        checkpointing.configure(two)
    with pytest.raises(ConfigError, match="mpu_=object has no get_model_parallel_world_size"):
        checkpointing.configure(object())
    with pytest.raises(ConfigError, match=r"activation_checkpointing.number_checkpoints=1.5: not a whole number"):
        checkpointing.configure(None, num_checkpoints=1.5)
    assert not checkpointing.is_configured()


class _Checkpointed(nn.Module):
    """Two hidden blocks, one with dropout drawn from the tracker's stream, one taking a keyword
    tensor: plain, under ``checkpoint`` or under ``non_reentrant_checkpoint``."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.mode = mode

    def block_a(self, x):
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            h = F.dropout(torch.tanh(self.a(x)), p=0.3)
        return h + F.dropout(x, p=0.1)  # and one mask from the default generator

    def block_b(self, x, *, scale):
        return torch.tanh(self.b(x)) * scale

    def forward(self, x, scale):
        x = self.inp(x)
        if self.mode == "plain":
            return self.out(self.block_b(self.block_a(x), scale=scale))
        if self.mode == "reentrant":
            x = deepspeed.checkpointing.checkpoint(self.block_a, x)
            return self.out(deepspeed.checkpointing.checkpoint(self.block_b, x, scale=scale))
        x = deepspeed.checkpointing.non_reentrant_checkpoint(self.block_a, x)
        block_b = deepspeed.checkpointing.non_reentrant_checkpoint(lambda h, s: self.block_b(h, scale=s), x, scale)
        return self.out(block_b)


def _grads_of(mode: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _Checkpointed(mode)
    scale = torch.full((8,), 1.5, requires_grad=True)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(5)
    loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)), scale).square().sum()
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, scale.grad


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_gradients_equal_the_plain_models(mode, caplog):
    """The recomputation sees the forward's random numbers (the default generator and the
    tracker's stream), a tensor passed by keyword gets its gradient, and cpu_checkpointing,
    synchronize and profile change no number (on the CPU there is nothing to move)."""
    want, want_scale = _grads_of("plain")
    checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True, profile=True)
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        got, got_scale = _grads_of(mode)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got_scale, want_scale)
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deepspeed.checkpointing: ")]
    assert sum("forward of block_a" in m for m in phases) == 1
    assert sum("recomputation of block_a" in m for m in phases) == 1


def test_rng_tracker():
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(3)
    default = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), default)  # the default stream did not move
    with tracker.fork():
        second = torch.rand(2)
    torch.manual_seed(3 + 2718)
    assert torch.equal(torch.cat([first, second]), torch.rand(4))  # one stream, seeded as DeepSpeed's
    with pytest.raises(ValueError, match="seed 2721 is already used"):
        tracker.add("other", 2721)
    with pytest.raises(ValueError, match="no stream 'nope'"):
        with tracker.fork("nope"):
            pass


def test_checkpoint_inside_a_zero3_model_trains_as_without_it():
    def losses(checkpointed: bool) -> list[float]:
        model = _Checkpointed("reentrant" if checkpointed else "plain")
        engine, *_ = deepspeed.initialize(model=model, config={**LOOP_CONFIG, "zero_optimization": {"stage": 3}})
        scale, out = torch.ones(8), []
        deepspeed.checkpointing.model_parallel_cuda_manual_seed(5)
        for x, y in DataLoader(_data(), batch_size=2):
            loss = F.mse_loss(engine(x, scale), y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        engine.destroy()
        dist.destroy_process_group()
        return out

    assert losses(True) == losses(False)


# ---------------------------------------------------------------------------- --local_rank
def test_local_rank_argument_sets_the_local_rank_without_the_variable(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")  # (set first, so that the test's end removes what initialize sets)
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)  # a parser that defines --local_rank already
    args = parser.parse_args(["--local_rank=1"])
    engine, *_ = deepspeed.initialize(args=args, model=nn.Linear(2, 1), config=LOOP_CONFIG)
    assert (engine.local_rank, deepspeed.comm.get_local_rank(), args.local_rank, os.environ["LOCAL_RANK"]) == \
        (1, 1, 1, "1")
    args.local_rank = 0
    with pytest.raises(ConfigError, match=r"args.local_rank=0 but LOCAL_RANK=1; valid: the same local rank"):
        deepspeed.initialize(args=args, model=nn.Linear(2, 1), config=LOOP_CONFIG)
    args.local_rank = "1"
    with pytest.raises(ConfigError, match=r"args.local_rank='1'; valid: an integer"):
        deepspeed.initialize(args=args, model=nn.Linear(2, 1), config=LOOP_CONFIG)
    args = parser.parse_args([])  # -1, LOCAL_RANK set: DeepSpeed's engine answers and aligns the argument
    engine, *_ = deepspeed.initialize(args=args, model=nn.Linear(2, 1), config=LOOP_CONFIG)
    assert (engine.local_rank, args.local_rank) == (1, 1)


# ---------------------------------------------------------------------------- deepspeed.ops, deepspeed.utils
def _adam_steps(make) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = make(model.parameters())
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        model(torch.randn(5, 4, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("w_mode", [True, False])
def test_deepspeed_adams_are_torchs_updates(w_mode):
    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    kwargs = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    torch_cls = torch.optim.AdamW if w_mode else torch.optim.Adam
    want = _adam_steps(lambda p: torch_cls(p, **kwargs))
    for got in (_adam_steps(lambda p: FusedAdam(p, adam_w_mode=w_mode, **kwargs)),
                _adam_steps(lambda p: DeepSpeedCPUAdam(p, adamw_mode=w_mode, fp32_optimizer_states=False, **kwargs))):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="FusedAdam: amsgrad=True; valid: False"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(ConfigError, match="FusedAdam: bias_correction=False; valid: True"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(ConfigError, match="DeepSpeedCPUAdam: amsgrad=True"):
        DeepSpeedCPUAdam(params, amsgrad=True)
    # DeepSpeed's ZeRO tests both: no zero_allow_untested_optimizer needed
    for opt in (FusedAdam(params), DeepSpeedCPUAdam(params)):
        cfg(zero_optimization={"stage": 2}).check_optimizer(opt, "optimizer")


def test_log_dist_and_repeating_loader(caplog):
    from zerotrain.deepspeed.utils import RepeatingLoader, log_dist

    with caplog.at_level(logging.INFO, logger="zerotrain"):
        log_dist("before", ranks=[1])  # no group: every call shows
        deepspeed.init_distributed()  # one process: a group of one (rank 0)
        log_dist("mine", ranks=[0])
        log_dist("theirs", ranks=[1])
        log_dist("nobody")
        log_dist("all", ranks=[-1])
    assert [r.getMessage() for r in caplog.records if r.name == "zerotrain.deepspeed"] == \
        ["[Rank -1] before", "[Rank 0] mine", "[Rank 0] all"]
    assert [x for _, x in zip(range(5), RepeatingLoader([1, 2]))] == [1, 2, 1, 2, 1]


# ---------------------------------------------------------------------------- fp16/bf16 inputs
def test_bf16_engine_and_direct_module_calls_take_bf16_inputs():
    """DeepSpeed's module is bf16, so scripts cast inputs and may call it directly; zerotrain's
    keeps fp32 weights, and a direct call runs under the engine's autocast (bf16 out)."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    engine, *_ = deepspeed.initialize(model=net, config={**LOOP_CONFIG, "bf16": {"enabled": True}})
    x = torch.randn(2, 4).to(torch.bfloat16)
    assert engine(x).dtype == torch.bfloat16 and net(x).dtype == torch.bfloat16
    assert net[0].weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")  # left after the call
    with torch.no_grad():
        assert net(x.float()).dtype == torch.bfloat16
    engine.destroy()
    assert net(x.float()).dtype == torch.float32  # the hooks are gone


# ---------------------------------------------------------------------------- a cifar10-style script
CIFAR_STYLE = '''
import argparse

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def test(model_engine, net, testset, local_device, target_dtype, test_batch_size=4):
    testloader = torch.utils.data.DataLoader(testset, batch_size=test_batch_size, shuffle=False, num_workers=0)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype != None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
            raw = net(images.to(local_device))  # the older tutorial evaluates the module itself
            assert torch.equal(torch.max(raw, 1)[1], predicted)
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total : .0f} %")


def main(args):
    deepspeed.init_distributed()
    # CIFAR-10's shapes, drawn at random (no download): 64 training and 16 test images
    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32, generator=g),
                                              torch.randint(0, 10, (64,), generator=g))
    testset = torch.utils.data.TensorDataset(torch.randn(16, 3, 32, 32, generator=g),
                                             torch.randint(0, 10, (16,), generator=g))
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()

    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype != None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    print("Finished Training")
    test(model_engine, net, testset, local_device, target_dtype)
    print("group", torch.distributed.get_rank(), torch.distributed.get_world_size())


if __name__ == "__main__":
    args = add_argument()
    main(args)
'''
CIFAR_RENAMES = (("import deepspeed\n", "import zerotrain.deepspeed as deepspeed\n"),
                 ("from deepspeed.accelerator import", "from zerotrain.deepspeed.accelerator import"),
                 ("from deepspeed.moe.utils import", "from zerotrain.deepspeed.moe.utils import"))


def test_cifar10_style_script_runs_in_one_process_without_a_launcher(tmp_path):
    """DeepSpeedExamples' training/cifar/cifar10_deepspeed.py pattern, imports renamed, started
    with plain ``python``: ``init_distributed()`` makes a group of one, so the script's own
    ``torch.distributed.get_rank()``/``barrier()`` work, and the process exits cleanly (the group
    is destroyed at exit)."""
    script = CIFAR_STYLE
    for old, new in CIFAR_RENAMES:
        assert script.count(old) == 1, old
        script = script.replace(old, new)
    path = tmp_path / "cifar10_deepspeed.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZEROTRAIN_LAUNCHED")}
    proc = subprocess.run([sys.executable, str(path), "--stage", "2", "--moe-param-group"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("[") and "loss:" in line for line in lines) == 4  # 2 epochs of 4 steps, every 2nd
    assert "Finished Training" in lines and "group 0 1" in lines
    assert any(line.startswith("Accuracy of the network on the 16 test images") for line in lines)
    assert "terminate called" not in proc.stderr
