"""zerotrain.deepspeed under fp16/bf16 starts the fp32 masters from the 16-bit-rounded weights, as
DeepSpeed does (it casts the module to the 16-bit type before its optimizer copies the masters).
Found running DeepSpeedExamples' training/cifar with bf16 (bench/CONFORMANCE.md): a warm-up's small
first update moved zerotrain's weights by a rounding step where DeepSpeed's stayed put."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed

from deepspeed_unit_common import BASE, _own_group_and_checkpointing  # noqa: F401 - autouse fixture


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _initialize(section: dict, stage: int, lr: float = 1e-3):
    model = _model()
    config = {**BASE, **section, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("section,dtype", [({"bf16": {"enabled": True}}, torch.bfloat16),
                                           ({"fp16": {"enabled": True}}, torch.float16),
                                           ({}, None)])
def test_masters_start_from_the_16bit_weights(section, dtype, stage):
    original = _model().state_dict()
    engine, _ = _initialize(section, stage)
    masters = engine._model.full_state_dict()  # the complete fp32 weights: ZeRO's masters, else the module's
    assert masters.keys() == original.keys()
    for name, o in original.items():
        want = o if dtype is None else o.to(dtype).float()
        if dtype == torch.bfloat16 and stage == 0:  # then DeepSpeed's 16-bit wrapper's step on zero
            want = want.mul(1 - 1e-3 * 0.01)  # gradients (ops/sixteen_bit.py): torch AdamW's decay once
        assert masters[name].dtype == torch.float32
        torch.testing.assert_close(masters[name], want, rtol=0, atol=0)
    if dtype is not None:
        assert any(not torch.equal(o, o.to(dtype).float()) for o in original.values())  # rounding changes them


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (2, True)])
def test_zero_reduces_gradients_in_the_16bit_type_as_deepspeed(stage, offload):
    """DeepSpeed reduces ZeRO's gradients in ``communication_data_type``, which under fp16/bf16
    defaults to that 16-bit type (its engine's ``communication_data_type``); zerotrain's ZeRO
    default is fp32. Found on DeepSpeedExamples' cifar with bf16 on 2 ranks (bench/CONFORMANCE.md):
    stages 2 and 3 equal DeepSpeed at every step only with the gradients summed in bf16."""
    from zerotrain.deepspeed.config import parse

    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    for section, want in (({"bf16": {"enabled": True}}, "bf16"), ({"fp16": {"enabled": True}}, "fp16")):
        assert parse({**BASE, **section, "zero_optimization": zero}, 2).strategy_options["reduce_dtype"] == want
    assert "reduce_dtype" not in parse({**BASE, "zero_optimization": zero}, 2).strategy_options


@pytest.mark.parametrize("given,precision,want", [("fp32", {"bf16": {"enabled": True}}, None),
                                                  ("FP16", {"bf16": {"enabled": True}}, "fp16"),
                                                  ("bf16", {}, "bf16")])
def test_communication_data_type_chooses_zeros_reduction_type(given, precision, want):
    """DeepSpeed's ``communication_data_type`` overrides the 16-bit default above (case-insensitive,
    as its config reader lowers it): fp32 under bf16 keeps the fp32 reduction, bf16 under fp32
    reduces in bf16."""
    from zerotrain.deepspeed.config import parse

    cfg = parse({**BASE, **precision, "communication_data_type": given, "zero_optimization": {"stage": 2}}, 2)
    assert cfg.strategy_options.get("reduce_dtype") == want
    assert not any(k.startswith("communication_data_type") for k in cfg.ignored)


def test_communication_data_type_refuses_other_types():
    from zerotrain import ConfigError
    from zerotrain.deepspeed.config import parse

    with pytest.raises(ConfigError, match=r"communication_data_type='int8'.*valid: fp32, fp16, bf16"):
        parse({**BASE, "communication_data_type": "int8", "zero_optimization": {"stage": 2}}, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_bf16_module_under_an_fp32_config_trains_as_under_bf16(stage):
    """DeepSpeed keeps a bf16 module under an fp32 config and its ZeRO-1/2 optimizer steps fp32
    copies of the bf16 partitions, as under ``bf16``; zerotrain converted the module to fp32
    (examples/sdma_allgather built eagerly with ``torch_dtype=bfloat16``: 3.4e-4 from the first loss)."""
    def losses(section: dict) -> list[float]:
        model = _model().bfloat16()
        config = {**BASE, **section, "zero_optimization": {"stage": stage},
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        g, out = torch.Generator().manual_seed(1), []
        for _ in range(3):
            loss = engine(torch.randn(2, 16, generator=g).bfloat16()).float().square().mean()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    assert losses({}) == losses({"bf16": {"enabled": True}})
