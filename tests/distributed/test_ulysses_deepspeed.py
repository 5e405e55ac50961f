"""``zerotrain.deepspeed.sequence.layer.DistributedAttention`` against DeepSpeed 0.19.8's own
``deepspeed.sequence.layer.DistributedAttention`` on 2 gloo ranks (DS_ACCELERATOR=cpu): the same
shards, the same local attention (causal SDPA), batch first and sequence first, MHA and GQA whose
KV heads divide the group: the outputs and the q/k/v gradients are identical.

# tolerance: exact. Both move the same values with all-to-alls (no arithmetic) and run the same
# local attention on the same per-rank tensors, so nothing is summed in another order.

Where DeepSpeed refuses (fewer KV heads than ranks: its AssertionError), ours repeats the KV heads
(tests/distributed/test_ulysses.py checks that against one process). DeepSpeed is not a dependency
of zerotrain: without it these tests skip.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.distributed as dist

from harness import init_dist, run_ranks

pytestmark = pytest.mark.timeout(300)

CASES = [(4, 4), (4, 2)]  # (query heads, KV heads), both dividing sp=2


def _compare_ranks():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = init_dist()
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention as Theirs

    from test_ulysses import _qkv, _shard
    from zerotrain.deepspeed.sequence.layer import DistributedAttention as Ours
    from zerotrain.strategies.parallel.ulysses import causal_sdpa

    deepspeed.init_distributed(dist_backend="gloo")  # joins the group already there

    def seq_first_sdpa(q, k, v):
        return causal_sdpa(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)

    out = {}
    for h, hkv in CASES:
        for batch_dim in (0, 1):
            got = {}
            for name, cls in (("deepspeed", Theirs), ("zerotrain", Ours)):
                shards = [_shard(t, rank, world).requires_grad_() for t in _qkv(h, hkv)]
                args = [t.transpose(0, 1) for t in shards] if batch_dim else shards
                attn = cls(seq_first_sdpa if batch_dim else causal_sdpa, dist.group.WORLD)
                y = attn(*args, batch_dim)
                y = y.transpose(0, 1) if batch_dim else y
                (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
                got[name] = [y.detach(), *(t.grad for t in shards)]
            out[f"{h}x{hkv} batch_dim_idx={batch_dim}"] = got
    return out


def test_equals_deepspeeds_distributed_attention(tmp_path):
    pytest.importorskip("deepspeed")
    for rank, result in enumerate(run_ranks("test_ulysses_deepspeed:_compare_ranks", 2, tmp_path, timeout=240)):
        for case, got in result.items():
            for what, theirs, ours in zip(["output", "q.grad", "k.grad", "v.grad"], got["deepspeed"], got["zerotrain"]):
                assert theirs.shape == ours.shape and torch.equal(theirs, ours), f"rank {rank} {case} {what}"


def test_signature_is_deepspeeds(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.sequence.layer import DistributedAttention as Theirs

    from zerotrain.deepspeed.sequence.layer import DistributedAttention as Ours
    for method in ("__init__", "forward"):
        theirs, ours = (inspect.signature(getattr(c, method)) for c in (Theirs, Ours))
        assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
               [(p.name, p.default, p.kind) for p in theirs.parameters.values()], method


def test_refusals_before_any_exchange():
    from zerotrain.deepspeed.sequence.layer import DistributedAttention
    with pytest.raises(NotImplementedError, match="sp_stream"):
        DistributedAttention(torch.nn.Identity(), None, sp_stream=object())
    with pytest.raises(NotImplementedError, match="scatter_idx=0, gather_idx=2"):
        DistributedAttention(torch.nn.Identity(), None, scatter_idx=0, gather_idx=2)
    attn = DistributedAttention(torch.nn.Identity(), None)
    q = torch.zeros(1, 2, 2, 1)
    with pytest.raises(NotImplementedError, match="rotary_pos_emb"):
        attn(q, q, q, 0, rotary_pos_emb=(q, q))
    with pytest.raises(ValueError, match="batch_dim_idx=2; valid: 0"):
        attn(q, q, q, 2)


def test_the_path_is_registered_once():
    import sys

    import zerotrain.deepspeed as deepspeed
    from zerotrain.deepspeed.sequence.layer import DistributedAttention
    from zerotrain.trainer.compat.deepspeed.sequence import layer
    assert "sequence.layer" in deepspeed.SUBMODULES and deepspeed.sequence.layer is layer
    assert sys.modules["zerotrain.deepspeed.sequence.layer"] is layer and DistributedAttention is layer.DistributedAttention
