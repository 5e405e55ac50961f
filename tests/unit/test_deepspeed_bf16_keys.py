"""DeepSpeed 0.19.8's ``torch_autocast`` section and its ``bf16.bf16_master_weights_and_grads`` /
``bf16.bf16_optimizer_states`` (DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json):
zerotrain ignored all three, so its bf16_full run equalled its baseline run where DeepSpeed's differs
(bench/CONFORMANCE.md). The forward now autocasts as DeepSpeed's. Both master keys true without
offload are ZeRO's ``master_dtype="bf16"`` (bf16 master partitions and moments, as DeepSpeed's);
every combination DeepSpeed refuses is refused with its rule, and the offload ones (DeepSpeedCPUAdam
stepping bf16 partitions) as not implemented."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.trainer.errors import ConfigError

from deepspeed_unit_common import BASE, _own_group_and_checkpointing, cfg  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)

FULL = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}


def test_the_keys_are_read():
    c = cfg(2, zero_optimization={"stage": 1}, bf16={"enabled": True, "bf16_master_weights_and_grads": False,
                                                     "bf16_optimizer_states": False},
            torch_autocast=FULL["torch_autocast"])
    assert c.torch_autocast_dtype == torch.bfloat16 and c.precision == "bf16-mixed"
    assert not [k for k in c.ignored if "bf16" in k or "autocast" in k]  # false: DeepSpeed's default, what runs
    for spelling, want in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                           ("half", torch.float16)):
        assert cfg(1, torch_autocast={"enabled": True, "dtype": spelling}).torch_autocast_dtype == want
    assert cfg(1, torch_autocast={"enabled": False, "dtype": "bf16"}).torch_autocast_dtype is None
    assert cfg(1, torch_autocast={"enabled": True}).torch_autocast_dtype == torch.get_autocast_dtype("cpu")


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("key", ["bf16", "bfloat16"])  # DeepSpeed's two spellings of the section
def test_bf16_masters_and_states_are_zeros_bf16_master_dtype(stage, key):
    """Both keys true: DeepSpeed steps bf16 master partitions with bf16 moments, on the device
    (``_configure_master_weights`` calls no offload check then) or under CPU offload with
    DeepSpeedCPUAdam (``fp32_optimizer_states`` forced false): ``master_dtype="bf16"``."""
    c = cfg(2, zero_optimization={"stage": stage}, **{key: FULL["bf16"]})
    assert c.strategy_options["master_dtype"] == "bf16" and c.make_strategy().config.master_dtype == "bf16"
    off = cfg(2, zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}}, **{key: FULL["bf16"]})
    assert off.strategy == "offload" and off.make_strategy().config.master_dtype == "bf16"
    assert "master_dtype" not in cfg(2, zero_optimization={"stage": stage}, bf16={"enabled": True}).strategy_options


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_master_combinations_are_refused_as_deepspeed_refuses_them_or_named(stage):
    """DeepSpeed: fp32 moments beside bf16 masters (``bf16_optimizer_states`` false) need ZeRO-Offload
    with DeepSpeedCPUAdam; zerotrain's 16-bit masters keep moments of their own type, and are stepped
    in host RAM only: those refused as not implemented, naming the key. One line, before any process."""
    offload = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    master_only = {"enabled": True, "bf16_master_weights_and_grads": True}
    with pytest.raises(ConfigError, match=r"^bf16\.bf16_master_weights_and_grads=True without bf16\.bf16_optimizer_"
                                          r"states and without zero_optimization\.offload_optimizer: .*DeepSpeed's rule"):
        cfg(2, zero_optimization={"stage": stage}, bf16=master_only)
    with pytest.raises(ConfigError, match=r"^bf16\.bf16_master_weights_and_grads=True under zero_optimization\."
                                          r"offload_optimizer: fp32 moments beside bf16 masters .*not implemented"):
        cfg(2, zero_optimization=offload, bf16=master_only)
    nvme = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError, match=r"offload_optimizer\.device='nvme' \(16-bit masters are stepped in host "
                                          r"RAM only\) not implemented"):
        cfg(2, zero_optimization=nvme, bf16=FULL["bf16"])
    with pytest.raises(ConfigError, match=r"^bfloat16\.bf16_master_weights_and_grads=True with bfloat16\.enabled "
                                          r"false: .*valid: bfloat16\.enabled true$"):
        cfg(2, zero_optimization={"stage": stage}, bfloat16={**FULL["bf16"], "enabled": False})


@pytest.mark.parametrize("keys,match", [
    ({"zero_optimization": {"stage": 0}, **FULL}, "stage=0; valid: stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
     "without bf16.bf16_master_weights_and_grads"),
    ({"torch_autocast": {"enabled": True, "dtype": "int4"}}, "not a DeepSpeed dtype name"),
])
def test_bad_combinations_are_refused_as_deepspeed_refuses_them(keys, match):
    with pytest.raises(ConfigError, match=match):
        cfg(2, **keys)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def test_torch_autocast_runs_the_forward_under_autocast():
    model = _model()
    config = {**BASE, "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 16)
    out = engine(x)
    assert out.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, _model()(x))
    engine.backward(out.float().sum())
    engine.step()


def test_stage_0_sums_gradients_in_the_16bit_type_as_deepspeed():
    """DeepSpeed's engine without ZeRO all-reduces in communication_data_type (the 16-bit training
    type by default), then divides: zerotrain's ddp gets ``reduce_dtype`` (cifar bf16 stage 0)."""
    assert cfg(2, zero_optimization={"stage": 0}, bf16={"enabled": True}).strategy_options["reduce_dtype"] == "bf16"
    assert cfg(2, zero_optimization={"stage": 0}, fp16={"enabled": True}).strategy_options["reduce_dtype"] == "fp16"
    assert "reduce_dtype" not in cfg(2, zero_optimization={"stage": 0}).strategy_options
    assert cfg(2, zero_optimization={"stage": 0}, bf16={"enabled": True},
               communication_data_type="fp32").strategy_options.get("reduce_dtype", "fp32") == "fp32"
    assert cfg(1, bf16={"enabled": True}).strategy == "single"


@pytest.mark.parametrize("stage,offload,enabled", [(1, True, True), (2, True, True), (3, True, True),
                                                   (2, True, False), (2, False, True)])
def test_fp16_masters_are_refused_too(stage, offload, enabled):
    """``fp16.fp16_master_weights_and_grads`` was reported as "no effect"; DeepSpeed 0.19.8 keeps fp16
    master partitions with it, always under offload with DeepSpeedCPUAdam (``_configure_master_weights``
    calls its offload check for fp16 whatever the states): without offload DeepSpeed's refusal, with it
    not implemented (DeepSpeed's fp32 moments beside them). False stays read, not reported
    (DeepSpeedExamples' cifar)."""
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    match = (r"^fp16\.fp16_master_weights_and_grads=True with zero_optimization\.offload_optimizer: not implemented "
             r".*valid: false \(DeepSpeed's default\)$" if offload else
             r"^fp16\.fp16_master_weights_and_grads=True without zero_optimization\.offload_optimizer: .*DeepSpeed's rule")
    with pytest.raises(ConfigError, match=match):
        cfg(2, zero_optimization=zero, fp16={"enabled": enabled, "fp16_master_weights_and_grads": True})
    with pytest.raises(ConfigError, match=r"stage=0; valid: stage 1, 2 or 3 \(DeepSpeed's rule\)"):
        cfg(2, zero_optimization={"stage": 0}, fp16={"enabled": enabled, "fp16_master_weights_and_grads": True})
    with pytest.raises(ConfigError, match=r"mutually exclusive \(DeepSpeed's rule\)"):
        cfg(2, zero_optimization=zero, fp16={"enabled": False, "fp16_master_weights_and_grads": True},
            bf16=FULL["bf16"])
    quiet = cfg(2, zero_optimization=zero, fp16={"enabled": enabled, "fp16_master_weights_and_grads": False})
    assert not [k for k in quiet.ignored if "fp16_master" in k]
