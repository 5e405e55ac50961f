"""ZeRO-3 under the DeepSpeed face steps as DeepSpeed 0.19.8's stage 3, bit for bit.

DeepSpeed's host Adam kernel (its CPU ``FusedAdam`` and ``DeepSpeedCPUAdam``) computes the last
``numel % 16`` elements of each call with other fused products, and its stage 3 calls it once per
sub-group on the concatenation of every parameter's own partition; zerotrain's ZeRO-3 slots end
elsewhere, so before the face passed DeepSpeed's tail elements to the kernel
(``trainer/compat/deepspeed/ops/stage3_tail.py``) a few elements per rank differed by an fp32 ulp
per step (DeepSpeedExamples' bf16_master_weight: one bf16 ulp of the loss at steps 3 and 7,
bench/CONFORMANCE.md). The model's sizes put DeepSpeed's tail (the last 14 elements of 254 per
rank: the head's bias) away from zerotrain's (the end of its one unit's halves).

DeepSpeed's stage 3 also puts an autograd identity on every tensor each module takes and returns
(its parameter hooks), so ``nn.MultiheadAttention(x, x, x)`` gets three distinct tensors and
projects them separately (three ``F.linear`` on slices of ``in_proj_weight``, DeepSpeed's stage-3
linear each), and ``x``'s gradient is a sum of four: the face adds the same identities
(``zero_init.use_module_boundaries``).

ZeRO-Offload's resumed run: DeepSpeedCPUAdam keeps ``beta^step`` in its C++ object (a running fp32
product); a fresh optimizer loading a checkpoint at step 2 recomputes it at step 3 by ``pow``
(``IncrementStep``), which differs from the running product in the last fp32 bit at step 3
(``0.999``: 0.99700302 vs 0.99700308). zerotrain's offload stepper kept one process-wide running
product; it now keeps DeepSpeed's per-optimizer state.

Two gloo ranks, different data per rank, the same model, data and config under DeepSpeed itself
(``DS_ACCELERATOR=cpu``) and under zerotrain.deepspeed: losses and final weights equal exactly (the
same fp32 operations on the same operands). Skipped without deepspeed (the ``dev`` extra).
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
              # both libraries, five runs each (~60 s alone); the default suite keeps
              # tests/unit/test_deepspeed_stage3_tail.py
              pytest.mark.slow]

STEPS = 5
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


class _Net(nn.Module):
    """Self-attention given one tensor three times, a residual, a head: 1156 parameters, 578 per
    rank; DeepSpeed's calls end with the head's bias, zerotrain's one unit's halves elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.attention(x, x, x)
        return self.head(x + a)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _config(case: str) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if "off" in case:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "optimizer": OPTIMIZER,
              # DeepSpeed's default, active here (this model's norms exceed it): its stage 3 sums the
              # clip norm over its own per-parameter partitions, in fp64 (the face: ops/zero_clip.py)
              "gradient_clipping": 1.0,
              "zero_optimization": zero}
    if "bf16" in case:
        config["bf16"] = {"enabled": True}
    if "masters" in case:
        config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return config


def _steps(ds, engine, g, n: int, dtype: torch.dtype) -> list[float]:
    losses = []
    for _ in range(n):
        x, y = torch.randn(4, 3, 16, generator=g), torch.randn(4, 3, 4, generator=g)
        loss = ((engine(x.to(dtype)).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train(impl: str, cases: list, ckpt: str) -> dict:
    """One rank: each case's losses and full final weights. ``resume``: 2 steps, a checkpoint, a
    fresh engine (and optimizer) loading it, 3 more steps."""
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for case in cases:
        dtype = torch.bfloat16 if "bf16" in case else torch.float32
        model = _model()
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_config(case))
        g = torch.Generator().manual_seed(100 + rank)
        if "resume" in case:
            losses = _steps(ds, engine, g, 2, dtype)
            engine.save_checkpoint(f"{ckpt}/{case}", tag="t")
            model = _model()
            engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_config(case))
            engine.load_checkpoint(f"{ckpt}/{case}", tag="t")
            losses += _steps(ds, engine, g, STEPS - 2, dtype)
        else:
            losses = _steps(ds, engine, g, STEPS, dtype)
        with ds.zero.GatheredParameters(list(engine.module.parameters())):
            weights = [p.detach().float().clone() for p in engine.module.parameters()]
        out[case] = {"losses": losses, "weights": weights}
    return out


CASES = ["fp32", "fp32_off", "bf16", "bf16_masters", "fp32_off_resume"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage3_tail")
    env = {"DS_ACCELERATOR": "cpu"}
    return {impl: run_ranks("test_deepspeed_stage3_kernel_tail:_train", 2, tmp / impl, timeout=400, env=env,
                            impl=impl, cases=CASES, ckpt=str(tmp / f"ckpt_{impl}"))
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("case", CASES)
def test_stage3_steps_as_deepspeeds_stage3(runs, case):
    """fp32: DeepSpeed's CPU FusedAdam (``fp32``) and DeepSpeedCPUAdam (``fp32_off``) on fp32
    partitions; ``bf16``: a bf16 model, fp32 masters (DeepSpeedExamples' baseline.json);
    ``bf16_masters``: bf16 masters and moments (``bf16_master_weights_and_grads``); ``resume``:
    the offload run resumed from a checkpoint by a fresh optimizer."""
    for rank in range(2):
        want, got = runs["ds"][rank][case], runs["zt"][rank][case]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for i, (a, b) in enumerate(zip(got["weights"], want["weights"])):
            assert torch.equal(a, b), (rank, i, (a - b).abs().max().item(), (a != b).sum().item())
