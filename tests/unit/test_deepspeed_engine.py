"""zerotrain.deepspeed without DeepSpeed, in one process: the engine loop against the plain PyTorch
loop it stands for, monitoring, ``zero.Init`` and ``GatheredParameters``, ``deepspeed.checkpointing``,
``--local_rank``, ``deepspeed.ops``/``utils``, fp16/bf16 inputs and a cifar10-style script (the
config keys are test_deepspeed_config.py's)."""
from __future__ import annotations

import argparse
import json
import logging
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
from zerotrain.deepspeed.config import ActivationCheckpointing

from deepspeed_unit_common import BASE, _own_group_and_checkpointing, cfg  # noqa: F401 - autouse fixture
from tolerance import assert_no_worse_than_peer, backward_as_ranks, mean_rtol


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


def _plain_loop(as_ranks: int = 0) -> tuple[nn.Module, list[float], list[float]]:
    """What DeepSpeed's engine does, in plain PyTorch: loss / GAS, step and schedule every GAS
    micro-batches, clipping, DeepSpeed's "Adam" (AdamW, stepped as DeepSpeed's host kernel steps
    fp32 CPU parameters: ``CPUAdam(order="deepspeed")``), the DistributedSampler's order.
    ``as_ranks=k``: the peer, each step's gradient summed as torch DDP sums it on k ranks."""
    model, data = _net(), _data()
    opt = zerotrain.ops.CPUAdam(model.parameters(), lr=0.05, weight_decay=0.1, order="deepspeed")
    sched = lr_schedules.WarmupLR(opt, warmup_num_steps=3, warmup_max_lr=0.05)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    losses, lrs, micro = [], [], []
    for i, (x, y) in enumerate(loader):
        with torch.set_grad_enabled(not as_ranks):
            loss = F.mse_loss(model(x), y)
        if not as_ranks:
            (loss / GAS).backward()
        losses.append(loss.item())
        micro.append((x, y))
        if (i + 1) % GAS == 0:
            if as_ranks:
                backward_as_ranks(model.parameters(), micro, lambda b: F.mse_loss(model(b[0]), b[1]), as_ranks)
            micro = []
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
    (ref, want_losses, want_lrs), (peer, peer_losses, _) = _plain_loop(), _plain_loop(as_ranks=2)
    # tolerance: no worse than DDP's order, + 2 mean_rtol(n) for the first step's two orders of one mean
    assert_no_worse_than_peer(torch.tensor(losses), torch.tensor(want_losses), torch.tensor(peer_losses), "losses",
                              floor=2 * mean_rtol(2 * 2))  # a micro-batch: 2 samples x 2 outputs
    assert lrs == pytest.approx(want_lrs, rel=1e-12)
    assert boundaries == [False, False, True] * 4
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (4, 12, 24)
    assert isinstance(sched, lr_schedules.WarmupLR) and isinstance(loader.sampler, DistributedSampler)
    full = engine.zerotrain_engine.strategy.full_state_dict()
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_no_worse_than_peer(full, ref.state_dict(), peer.state_dict())
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
    from zerotrain.strategies.zero.stage3.unit import is_placeholder

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


def test_save_16bit_model_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    model = _net()
    engine, *_ = deepspeed.initialize(model=model, config={**LOOP_CONFIG, "zero_optimization": {"stage": 2}})
    assert engine.save_16bit_model(tmp_path) is True
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())  # fp32: no 16-bit section
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]  # no temporary file left
    before = (tmp_path / "pytorch_model.bin").read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"half a file")
        raise OSError(28, "No space left on device", str(tmp_path / "pytorch_model.bin.tmp"))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(zerotrain.CheckpointError, match=r"save_16bit_model\(.*\) failed: rank 0: writing "
                                                         r".*pytorch_model\.bin\.tmp: No space left on device"):
        engine.save_16bit_model(tmp_path)
    assert (tmp_path / "pytorch_model.bin").read_bytes() == before  # the old file is whole
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]


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
    want = _adam_steps(lambda p: torch_cls(p, foreach=True, **kwargs))
    peer = _adam_steps(lambda p: torch_cls(p, foreach=False, **kwargs))  # torch's other arithmetic of the same steps
    for got in (_adam_steps(lambda p: FusedAdam(p, adam_w_mode=w_mode, **kwargs)),
                _adam_steps(lambda p: DeepSpeedCPUAdam(p, adamw_mode=w_mode, fp32_optimizer_states=False, **kwargs))):
        # tolerance: no worse than torch's own two Adam implementations differ (PEER_FACTOR x + 4 ulps)
        assert_no_worse_than_peer(dict(enumerate(got)), dict(enumerate(want)), dict(enumerate(peer)))
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
