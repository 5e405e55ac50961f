"""bf16 at ZeRO stages 1-3 as DeepSpeed 0.19.8 runs it: its engine casts the module's parameters to
bf16 (buffers keep their type) and runs the forward without autocast, so the ops inside the model's
forward that autocast would run in fp32 (LayerNorm, softmax, ``cross_entropy``) compute in bf16 and
the loss is bf16. zerotrain's face ran the forward under autocast: its losses were fp32 and 1-2
bf16 steps away from DeepSpeed's (DeepSpeed's examples/sdma_allgather/train_zero3.py, DeepSpeedExamples'
HelloDeepSpeed; bench/CONFORMANCE.md, "Other upstream DeepSpeed scripts").

Two gloo ranks, the same tiny attention model (embedding, LayerNorm, softmax attention, a frozen
linear layer, an fp32 buffer used in fp32, ``cross_entropy`` inside the forward), data and bf16
config under DeepSpeed itself (``DS_ACCELERATOR=cpu``) and under zerotrain.deepspeed, at ZeRO 1, 2
and 3 (eager and under ``zero.Init``): every loss, its dtype and every final weight identical. Exact
equality is the derived bound: both run the same bf16 ops on the same bf16 operands in the forward
and backward, sum the bf16 gradients in the same order on two ranks, and step torch's AdamW
(``torch_adam``) on the same fp32 master partitions; no clipping (``gradient_clipping: 0``), so no
norm is summed in another order. Skipped without deepspeed (the ``dev`` extra).
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import needs
from harness import run_ranks

pytestmark = [needs.deepspeed,
              pytest.mark.timeout(600),
              # both libraries at four set-ups (~60 s): the default suite keeps
              # tests/unit/test_deepspeed_bf16_module.py (the forward's dtypes, one process)
              pytest.mark.slow]

STEPS, VOCAB, WIDTH, HEADS = 5, 32, 16, 2
CONFIG = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
          "bf16": {"enabled": True}}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)  # frozen once built (outside zero.Init)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("scale", torch.full((WIDTH,), 0.1))  # 0.1: not a bf16 value

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = (self.ln(h).float() * self.scale).to(h.dtype)  # the buffer in its own type
        b, t, _ = h.shape
        q, k, v = (x.view(b, t, HEADS, -1).transpose(1, 2) for x in self.qkv(h).split(WIDTH, dim=-1))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(WIDTH // HEADS), dim=-1)
        h = h + (att @ v).transpose(1, 2).reshape(b, t, WIDTH)
        h = h + self.frozen(h)
        return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))


def _train(impl: str, cases: list) -> dict:
    """One rank: for each case (a ZeRO stage, ``"3_init"``: stage 3 built under ``zero.Init``),
    ``STEPS`` steps; the losses, their dtype and the full final weights (fp32)."""
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for case in cases:
        config = {**CONFIG, "zero_optimization": {"stage": int(case[0])}}
        torch.manual_seed(0)
        if case.endswith("_init"):
            with ds.zero.Init(config_dict_or_path=config):
                model = _Net()
        else:
            model = _Net()
        model.frozen.requires_grad_(False)
        engine, *_ = ds.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=config)
        g = torch.Generator().manual_seed(100 + rank)
        losses, dtypes = [], set()
        for _ in range(STEPS):
            ids, labels = torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            dtypes.add(str(loss.dtype))
        with ds.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        out[case] = {"losses": losses, "dtypes": sorted(dtypes), "weights": weights,
                     "scale": str(engine.module.scale.dtype)}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_module")
    env = {"DS_ACCELERATOR": "cpu"}
    return {impl: run_ranks("test_deepspeed_bf16_module:_train", 2, tmp / impl, timeout=400, env=env, impl=impl,
                            cases=["1", "2", "3", "3_init"])
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("case", ["1", "2", "3", "3_init"])
def test_bf16_forward_equals_deepspeeds_bf16_module(runs, case):
    for rank in range(2):
        want, got = runs["ds"][rank][case], runs["zt"][rank][case]
        assert want["dtypes"] == ["torch.bfloat16"] and got["dtypes"] == want["dtypes"], (got["dtypes"], want["dtypes"])
        assert got["scale"] == want["scale"], (got["scale"], want["scale"])  # buffers keep their type
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        assert got["weights"].keys() == want["weights"].keys()
        for name, w in want["weights"].items():
            assert torch.equal(got["weights"][name], w), (rank, name, (got["weights"][name] - w).abs().max().item())
