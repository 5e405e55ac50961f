"""ZeRO stages 1-3 under the DeepSpeed face clip as DeepSpeed 0.19.8's ZeRO optimizers do, bit for bit.

DeepSpeed sums the clip norm over its own partitions (stage 1/2: each rank's fp64 sum of squared
piece norms rounded to fp32, all-reduced; stage 3: per-parameter partitions, fp64 throughout) and
multiplies by ``1 / max(1, (norm + 1e-6) / clip)``; zerotrain's strategies take torch's order over
their partitions, one fp32 ulp away now and then, which Adam amplifies in a gradient that is zero
up to rounding: here the key part of the q/k/v bias (softmax ignores a bias shared by every key).
The model is DeepSpeed's ``DistributedAttention`` (a local causal SDPA over the world group, each
rank its half of every sequence) trained through ``initialize`` with DeepSpeed's default
``gradient_clipping`` 1.0, which every step of this model exceeds. Before the face clipped in
DeepSpeed's arithmetic (``trainer/compat/deepspeed/ops/zero_clip.py``) the final weights differed at
every stage (``blocks.1.qkv.bias`` up to 1.3e-3 relative in 4 steps, bench/CONFORMANCE.md).

Two gloo ranks, the same script under DeepSpeed itself (``DS_ACCELERATOR=cpu``) and under
zerotrain.deepspeed: losses and final weights equal exactly. Skipped without deepspeed."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import needs
from harness import run_ranks

pytestmark = [needs.deepspeed, pytest.mark.timeout(900),
              # both libraries, four cases each (~2 min alone); the default suite keeps
              # tests/unit/test_deepspeed_zero_clip.py (the arithmetic against DeepSpeed's methods)
              pytest.mark.slow]

D, HEADS, VOCAB, SEQ, BATCH, STEPS = 16, 4, 32, 8, 2, 4
CASES = ["s1", "s2", "s3", "s2_off"]


def _net(ds) -> nn.Module:
    import torch.distributed as dist
    import torch.nn.functional as F

    class LocalAttention(nn.Module):
        def forward(self, q, k, v):  # [B, S, h, d]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return o.transpose(1, 2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
            self.attn = ds.sequence.layer.DistributedAttention(LocalAttention(), dist.group.WORLD)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, D // HEADS).unbind(2)
            x = x + self.proj(self.attn(q, k, v, 0).reshape(b, s, D))
            return x + self.mlp(self.ln2(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(D, VOCAB)

        def forward(self, tok, pos):
            x = self.emb(tok) + self.pos(pos)
            for blk in self.blocks:
                x = blk(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _train(impl: str, cases: list) -> dict:
    """One rank: each stage's losses and full final weights."""
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    importlib.import_module(f"{ds.__name__}.sequence.layer")
    import torch.distributed as dist
    import torch.nn.functional as F

    ds.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for case in cases:
        zero = {"stage": int(case[1])}
        if zero["stage"] == 3:
            zero["stage3_param_persistence_threshold"] = 0
        adamw = {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}
        if case.endswith("_off"):  # DeepSpeedCPUAdam on the host partitions (the norm summed in Python floats)
            zero["offload_optimizer"] = {"device": "cpu"}
            del adamw["torch_adam"]
        config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": 1000, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": adamw}}
        model = _net(ds)
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
        g = torch.Generator().manual_seed(1234)  # the same batches on both ranks, each its half of the sequence
        shard = SEQ // world
        losses = []
        for _ in range(STEPS):
            tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
            mine = slice(rank * shard, (rank + 1) * shard)
            logits = engine(tok[:, :-1][:, mine], torch.arange(SEQ)[mine].expand(BATCH, shard))
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tok[:, 1:][:, mine].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        names = [n for n, _ in engine.module.named_parameters()]
        with ds.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().float().clone() for n, p in zip(names, engine.module.parameters())}
        out[case] = {"losses": losses, "weights": weights}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_clip")
    env = {"DS_ACCELERATOR": "cpu"}
    return {impl: run_ranks("test_deepspeed_zero_clip_ranks:_train", 2, tmp / impl, timeout=600, env=env,
                            impl=impl, cases=CASES)
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("case", CASES)
def test_clipped_steps_equal_deepspeeds(runs, case):
    """ZeRO ``case`` (stage 1, 2 or 3), fp32, torch's AdamW (``torch_adam``), clipping 1.0;
    ``s2_off``: stage 2 with ``offload_optimizer`` cpu (DeepSpeedCPUAdam)."""
    for rank in range(2):
        want, got = runs["ds"][rank][case], runs["zt"][rank][case]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for name, w in want["weights"].items():
            v = got["weights"][name]
            assert torch.equal(v, w), (rank, name, (v - w).abs().max().item(), (v != w).sum().item())
