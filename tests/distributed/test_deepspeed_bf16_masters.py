"""DeepSpeed 0.19.8's ``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (its
DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json): each rank's master partition,
its gradient and the optimizer's moments are bf16, stepped in place. zerotrain refused the keys; it
now runs them as ZeRO's ``master_dtype="bf16"`` (the working bf16 partition is the master).

Two gloo ranks, ZeRO 1, 2 and 3, the same tiny model, data and config under DeepSpeed itself
(``DS_ACCELERATOR=cpu``) and under zerotrain.deepspeed: every loss and every final weight
identical. Exact equality is the derived bound: with ``torch_adam`` both step torch's AdamW on the
same bf16 partitions with the same bf16 gradients (summed in bf16, DeepSpeed's default
``communication_data_type``), so every operation sees the same operands (measured on
DeepSpeedExamples' script: bench/CONFORMANCE.md). Under CPU offload (ZeRO 1 and 2) DeepSpeed steps
its bf16 partitions with DeepSpeedCPUAdam (fp32 arithmetic, one rounding to bf16 per stored value)
and zerotrain with its fused host kernel: the same fp32 arithmetic in another order (DeepSpeed's
``m*b1 + g*(1-b1)`` and ``p + p*(-lr*wd)``, torch's lerp and ``p*(1-lr*wd)`` here), so the fp32
results may differ in their last bits and, rounded to bf16, by one bf16 ulp (2^-8 relative) per
step: the bound is ``STEPS`` bf16 ulps of each tensor's largest value (measured: DeepSpeedExamples'
bf16_full at ZeRO 1/2 offload identical over 8 steps; here the last of 5 losses 2e-4 apart).
Skipped without deepspeed (the ``dev`` extra).
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import needs
from harness import run_ranks

pytestmark = [needs.deepspeed,
              pytest.mark.timeout(600),
              # the module's fixture runs both libraries at every stage (~90 s alone): the default
              # suite keeps tests/unit/test_deepspeed_fused_adam_bf16.py and test_zero_master_dtype.py
              pytest.mark.slow]

STEPS = 5
CONFIG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _train(impl: str, stages: list, master: bool = True) -> dict:
    """One rank: for each stage (or ``"<stage>_off"``: with CPU offload), ``STEPS`` steps; the
    losses and the full final weights (fp32)."""
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for case in stages:
        stage, offload, fused = int(str(case)[0]), str(case).endswith("_off"), str(case).endswith("_fused")
        bf16 = {**CONFIG["bf16"], "bf16_master_weights_and_grads": master, "bf16_optimizer_states": master}
        zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        optimizer = CONFIG["optimizer"]
        if offload or fused:  # offload: DeepSpeed's bf16 masters need its DeepSpeedCPUAdam, not torch's;
            # fused: the config as DeepSpeedExamples gives it, DeepSpeed's FusedAdam on the device
            optimizer = {"type": "AdamW", "params": {k: v for k, v in optimizer["params"].items() if k != "torch_adam"}}
        config = {**CONFIG, "bf16": bf16, "zero_optimization": zero, "optimizer": optimizer}
        model = _model()
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(STEPS):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
            loss = ((engine(x.bfloat16()).float() - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with ds.zero.GatheredParameters(list(engine.module.parameters())):
            weights = [p.detach().float().clone() for p in engine.module.parameters()]
        out[str(case)] = {"losses": losses, "weights": weights}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_masters")
    env = {"DS_ACCELERATOR": "cpu"}
    return {impl: run_ranks("test_deepspeed_bf16_masters:_train", 2, tmp / impl, timeout=400, env=env,
                            impl=impl, stages=["1", "2", "3", "1_off", "2_off", "1_fused", "2_fused", "3_fused"])
            for impl in ("ds", "zt")}


BF16_ULP = 2.0 ** -8  # bf16's spacing relative to a value in [1, 2)


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_bf16_masters_and_states_equal_deepspeeds(runs, stage):
    for rank in range(2):
        want, got = runs["ds"][rank][stage], runs["zt"][rank][stage]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
            assert torch.equal(a, b), (rank, i, (a - b).abs().max().item())


@pytest.mark.parametrize("stage", ["1_off", "2_off"])
def test_bf16_masters_under_offload_are_deepspeedcpuadams_within_a_bf16_ulp_per_step(runs, stage):
    bound = STEPS * BF16_ULP
    for rank in range(2):
        want, got = runs["ds"][rank][stage], runs["zt"][rank][stage]
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) <= bound * abs(b), (rank, got["losses"], want["losses"])
        for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
            assert (a - b).abs().max() <= bound * b.abs().max(), (rank, i, (a - b).abs().max().item())
        assert got["weights"][0].ne(runs["zt"][rank][stage[0]]["weights"][0]).any()  # not the device run


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_bf16_masters_on_device_step_as_deepspeeds_fusedadam(runs, stage):
    """No ``torch_adam`` and no offload: DeepSpeed steps the bf16 partitions with its FusedAdam,
    on its CPU accelerator the host kernel DeepSpeedCPUAdam runs (fp32 arithmetic, one rounding),
    not torch's AdamW (every operation in bf16). The face's "AdamW" steps bf16 parameters with
    zerotrain's fused host kernel, so a device run equals the offload run of the same stage bit
    for bit (same kernel, same operands; DeepSpeed's two runs are equal too, checked here) and is
    within the offload bound of DeepSpeed's. torch's AdamW on the bf16 partitions parts from the
    kernel within the 5 steps (fails without the face's kernel step)."""
    bound = STEPS * BF16_ULP
    for rank in range(2):
        want, got = runs["ds"][rank][stage + "_fused"], runs["zt"][rank][stage + "_fused"]
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) <= bound * abs(b), (rank, got["losses"], want["losses"])
        for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
            assert (a - b).abs().max() <= bound * b.abs().max(), (rank, i, (a - b).abs().max().item())
        if stage + "_off" in runs["zt"][rank]:
            for impl in ("ds", "zt"):
                off, dev = runs[impl][rank][stage + "_off"], runs[impl][rank][stage + "_fused"]
                assert dev["losses"] == off["losses"], (impl, rank, dev["losses"], off["losses"])
                for i, (a, b) in enumerate(zip(dev["weights"], off["weights"])):
                    assert torch.equal(a, b), (impl, rank, i, (a - b).abs().max().item())
