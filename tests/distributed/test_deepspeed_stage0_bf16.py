"""bf16 at ZeRO stage 0, two gloo ranks, against DeepSpeed 0.19.8 itself (``DS_ACCELERATOR=cpu``).

DeepSpeed wraps the optimizer there in its 16-bit optimizer: ``FP16_Optimizer`` around its
FusedAdam (the config's "Adam"), ``FP16_UnfusedOptimizer`` around torch's AdamW (``torch_adam``).
Both step once on zero gradients at set-up and clip by their own norm; the fused one steps one flat
fp32 master per group in one host-kernel call. zerotrain's face now does the same
(``trainer/compat/deepspeed/ops/sixteen_bit.py``); before, DeepSpeedExamples' cifar was one bf16 ulp
apart from step 15, and this model's weights after the first step. The forward runs on the bf16
rounding of every parameter and buffer, as DeepSpeed's bf16 module does (``embedded``: an
embedding and a LayerNorm, which autocast alone left on fp32 weights).

Exact equality is the derived bound: the forward (a bf16 module there, fp32 parameters under bf16
autocast here: the same bf16 operands for linear and tanh), the bf16 gradient sum and the optimizer
arithmetic are the same operations on the same values. Compared: every loss of both ranks and the
fp32 masters at the end (DeepSpeed's wrapper's, zerotrain's module parameters). ``weight_decay``
and ``gradient_clipping`` are chosen so that the set-up step moves the weights and every step
clips. Skipped without deepspeed (the ``dev`` extra).
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
              # both libraries in 2 processes each (~40 s): the default suite keeps
              # tests/unit/test_deepspeed_stage0_bf16.py (the same arithmetic written out, one process)
              pytest.mark.slow]

STEPS = 4
CASES = ["fused", "torch_adam", "embedded"]  # embedded: an embedding and a LayerNorm, fused
CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 0}, "gradient_clipping": 0.05,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.999], "weight_decay": 0.1}}}


class _Embedded(nn.Module):
    """Ops autocast leaves alone (DeepSpeed's bf16 module runs them on bf16 weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(40, 16), nn.LayerNorm(16), nn.Linear(16, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids))).mean(1)


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    if case == "embedded":
        return _Embedded()
    return nn.Sequential(nn.Linear(16, 21), nn.Tanh(), nn.Linear(21, 5))  # 467 elements: 467 % 16 = 3


def _masters(ds, engine) -> torch.Tensor:
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups_flat"):  # DeepSpeed's FP16_Optimizer
        return torch.cat([t.detach().reshape(-1) for t in opt.fp32_groups_flat])
    if hasattr(opt, "fp32_groups"):  # its FP16_UnfusedOptimizer
        return torch.cat([p.detach().reshape(-1) for g in opt.fp32_groups for p in g])
    return torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])  # zerotrain


def _train(impl: str, cases: list) -> dict:
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for case in cases:
        params = dict(CONFIG["optimizer"]["params"], **({"torch_adam": True} if case == "torch_adam" else {}))
        config = {**CONFIG, "optimizer": {"type": "Adam", "params": params}}
        model = _model(case)
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(STEPS):
            x, y = torch.randn(2, 16, generator=g), torch.randn(2, 5, generator=g)
            x = torch.randint(0, 40, (2, 6), generator=g) if case == "embedded" else x.bfloat16()
            loss = ((engine(x).float() - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[case] = {"losses": losses, "masters": _masters(ds, engine).clone()}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage0_bf16")
    return {impl: run_ranks("test_deepspeed_stage0_bf16:_train", 2, tmp / impl, timeout=300,
                            env={"DS_ACCELERATOR": "cpu"}, impl=impl, cases=CASES)
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("case", CASES)
def test_stage0_bf16_equals_deepspeeds_16bit_optimizer(runs, case):
    for rank in range(2):
        want, got = runs["ds"][rank][case], runs["zt"][rank][case]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        assert torch.equal(got["masters"], want["masters"]), (rank, (got["masters"] - want["masters"]).abs().max())
