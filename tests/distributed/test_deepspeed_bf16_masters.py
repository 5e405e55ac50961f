"""DeepSpeed 0.19.8's ``bf16.bf16_master_weights_and_grads`` with ``bf16_optimizer_states`` (its
DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json): each rank's master partition,
its gradient and the optimizer's moments are bf16, stepped in place. zerotrain refused the keys; it
now runs them as ZeRO's ``master_dtype="bf16"`` (the working bf16 partition is the master).

Two gloo ranks, ZeRO 1, 2 and 3, the same tiny model, data and config under DeepSpeed itself
(``DS_ACCELERATOR=cpu``) and under zerotrain.deepspeed: every loss and every final weight
identical. Exact equality is the derived bound: with ``torch_adam`` both step torch's AdamW on the
same bf16 partitions with the same bf16 gradients (summed in bf16, DeepSpeed's default
``communication_data_type``), so every operation sees the same operands (measured on
DeepSpeedExamples' script: bench/CONFORMANCE.md). Skipped without deepspeed (the ``dev`` extra).
"""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from torch import nn

from harness import run_ranks

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed (zerotrain's `dev` extra); this compares "
                                        "against it"),
              pytest.mark.timeout(600)]

STEPS = 5
CONFIG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _train(impl: str, stages: list[int], master: bool = True) -> dict:
    """One rank: for each stage, ``STEPS`` steps; the losses and the full final weights (fp32)."""
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for stage in stages:
        bf16 = {**CONFIG["bf16"], "bf16_master_weights_and_grads": master, "bf16_optimizer_states": master}
        config = {**CONFIG, "bf16": bf16, "zero_optimization": {"stage": stage}}
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
        out[stage] = {"losses": losses, "weights": weights}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_masters")
    env = {"DS_ACCELERATOR": "cpu"}
    return {impl: run_ranks("test_deepspeed_bf16_masters:_train", 2, tmp / impl, timeout=400, env=env,
                            impl=impl, stages=[1, 2, 3])
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_and_states_equal_deepspeeds(runs, stage):
    for rank in range(2):
        want, got = runs["ds"][rank][stage], runs["zt"][rank][stage]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
            assert torch.equal(a, b), (rank, i, (a - b).abs().max().item())
