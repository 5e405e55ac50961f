"""ZeRO's ``master_dtype``: 16-bit master partitions (the working partition itself, stepped in
place by the user's optimizer, whose state then is 16-bit too), as DeepSpeed's
``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` keep them. Checked before any process
starts (a ConfigError from the Trainer's and Engine's set-up: the precision's working type must be
the master type); offload refuses it (its kernel steps fp32 masters). On one process the step
equals torch's AdamW on the bf16 module bit for bit (the same operations on the same bf16 values);
the two-rank comparison with DeepSpeed itself is tests/distributed/test_deepspeed_bf16_masters.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.strategies import strategy_from_name
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.launch.job import plugins

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)


def test_bad_values_and_combinations_are_refused_before_any_process():
    with pytest.raises(ValueError, match=r"^ZeRO: master_dtype='fp8'; valid choices: fp32, bf16, fp16$"):
        strategy_from_name("zero2", master_dtype="fp8")
    for precision, master, valid in (("32", "bf16", "fp32"), ("16-mixed", "bf16", "fp32 or fp16"),
                                     ("bf16-mixed", "fp16", "fp32 or bf16")):
        with pytest.raises(ConfigError, match=rf"^Trainer: ZeRO: master_dtype='{master}' with precision="
                                              rf"'{precision}' .*valid: {valid}$"):
            plugins("Trainer", strategy_from_name("zero1", master_dtype=master), precision, 2)
    for stage in ("zero1", "zero2", "zero3"):
        _, built = plugins("Trainer", strategy_from_name(stage, master_dtype="bf16"), "bf16-mixed", 2)
        assert built.config.master_dtype == "bf16"
    plugins("Trainer", strategy_from_name("zero2", master_dtype="fp16"), "16-mixed", 2)
    with pytest.raises(ValueError, match=r"^offload: master_dtype='bf16' with optimizer_device='nvme', "
                                         r"param_device='none': 16-bit masters are stepped in host RAM only"):
        strategy_from_name("offload", stage=2, master_dtype="bf16", optimizer_device="nvme", nvme_path="/tmp")
    # the host steps 16-bit masters with gradients of their own type: said at construction, not at set-up
    with pytest.raises(ValueError, match=r"^offload: master_dtype='bf16' with reduce_dtype='fp32': .*valid: "
                                         r"reduce_dtype='bf16'$"):
        strategy_from_name("offload", stage=2, master_dtype="bf16")
    built = strategy_from_name("offload", stage=2, master_dtype="bf16", reduce_dtype="bf16")
    assert built.config.master_dtype == "bf16"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(4)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_step_as_torch_adamw_on_the_bf16_module(stage):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ref = _model().bfloat16()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in _batches():
        loss = ((engine(x.bfloat16()).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        want = ((ref(x.bfloat16()).float() - y) ** 2).mean()
        want.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == want.item()
    state = engine.optimizer.state_dict()["state"] if stage != 3 else None
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for p, r in zip(model.parameters(), ref.parameters()):
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), r.detach())
    if state is not None:  # the moments follow the masters' type
        assert state and all(v.dtype == torch.bfloat16 for st in state.values() for k, v in st.items() if k != "step")


def test_bf16_masters_keep_no_fp32_copy_and_half_the_moments():
    """The memory the option is for: no master bytes beside the working bf16 parameters, and the
    Adam moments (plus the 4-byte step counter) in 2 bytes instead of 4."""
    reports = {}
    for master in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  "bf16": {"enabled": True, "bf16_master_weights_and_grads": master, "bf16_optimizer_states": master}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(torch.randn(2, 64).bfloat16()).float().sum())
        engine.step()
        reports[master] = engine._zt._strategy.memory_report()
        torch.distributed.destroy_process_group()
    numel = 2 * (64 * 64 + 64)
    assert reports[False]["master"] == 4 * numel and reports[True]["master"] == 0
    assert reports[False]["optimizer"] - 4 == 8 * numel and reports[True]["optimizer"] - 4 == 4 * numel
    assert reports[True]["params"] == reports[False]["params"] == 2 * numel


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_checkpoint_resumes_bf16_masters_exactly(stage, tmp_path):
    """Saved after 3 of 6 steps and loaded into a fresh engine: the last 3 losses, the weights and
    the moments' type as without the interruption."""
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    xs = [x.bfloat16() for x, _ in _batches()] * 2
    runs = []
    for resume in (False, True):
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        if resume:
            engine.load_checkpoint(str(tmp_path))
        losses = []
        for i, x in enumerate(xs[3:] if resume else xs):
            if not resume and i == 3:
                engine.save_checkpoint(str(tmp_path))
            loss = (engine(x).float() ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = [p.detach().clone() for p in model.parameters()]
        runs.append((losses[-3:], weights))
        if stage != 3:
            assert all(v.dtype == torch.bfloat16 for st in engine.optimizer.state_dict()["state"].values()
                       for k, v in st.items() if k != "step")
        torch.distributed.destroy_process_group()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def _offload_run(stage: int, master: bool) -> list:
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage, "offload_optimizer":
                                                                         {"device": "cpu"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": master, "bf16_optimizer_states": master}}
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in _batches():
        engine.backward(((engine(x.bfloat16()).float() - y) ** 2).mean())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = [p.detach().clone() for p in model.parameters()]
    torch.distributed.destroy_process_group()
    return weights


def test_offloaded_bf16_masters_step_in_host_ram_alike_at_every_stage():
    """Under CPU offload the fused host kernel steps the bf16 partitions themselves (fp32 arithmetic,
    one rounding): the same values at ZeRO 1, 2 and 3 on one process, and not the fp32-master run."""
    runs = [_offload_run(stage, True) for stage in (1, 2, 3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    assert any(not torch.equal(a, b) for a, b in zip(runs[0], _offload_run(1, False)))
