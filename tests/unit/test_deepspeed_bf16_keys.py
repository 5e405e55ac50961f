"""DeepSpeed 0.19.8's ``torch_autocast`` section and its rules for ``bf16.bf16_master_weights_and_grads``
/ ``bf16.bf16_optimizer_states`` (DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json):
zerotrain ignored all three, so its bf16_full run equalled its baseline run where DeepSpeed's differs
(bench/CONFORMANCE.md). The forward now autocasts as DeepSpeed's; the master keys stay ignored
(zerotrain's ZeRO keeps fp32 masters), but DeepSpeed's refusals of their bad combinations hold."""
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
    c = cfg(2, zero_optimization={"stage": 1}, **FULL)
    assert c.torch_autocast_dtype == torch.bfloat16 and c.precision == "bf16-mixed"
    # the bf16 master keys are checked, and named as ignored: zerotrain's ZeRO keeps fp32 masters
    assert [k.split("=")[0] for k in c.ignored if "bf16" in k] == ["bf16.bf16_master_weights_and_grads",
                                                                   "bf16.bf16_optimizer_states"]
    assert not [k for k in c.ignored if "autocast" in k]
    for spelling, want in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                           ("half", torch.float16)):
        assert cfg(1, torch_autocast={"enabled": True, "dtype": spelling}).torch_autocast_dtype == want
    assert cfg(1, torch_autocast={"enabled": False, "dtype": "bf16"}).torch_autocast_dtype is None
    assert cfg(1, torch_autocast={"enabled": True}).torch_autocast_dtype == torch.get_autocast_dtype("cpu")


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
