"""ALST's faces (``zerotrain.deepspeed.runtime.sequence_parallel.ulysses_sp``) against DeepSpeed
0.19.8's own ``deepspeed.runtime.sequence_parallel.ulysses_sp`` on 2 gloo ranks (DS_ACCELERATOR=cpu):

* ``UlyssesSPDataLoaderAdapter`` over one epoch of a loader giving each rank its own batches
  (tensors and a non-tensor entry, ignored labels): the same number of micro-batches, the same
  keys, every tensor identical (``shift_labels`` included), the same end of epoch;
* ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, ...)`` on a tiny Llama (GQA
  4/2, rotary), each rank running the adapter's first micro-batch: the shard's summed loss and every
  parameter gradient.

# tolerance: the data exactly (values are only moved); the loss and gradients within rel 1e-4
# (issue 45's bound for DeepSpeed's faces; both run transformers' SDPA on the same gathered heads).
Training under ``deepspeed.initialize(mpu=...)`` at ZeRO 0-3: test_deepspeed_alst.py. Skips without
deepspeed or transformers.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import init_dist, run_ranks

pytestmark = pytest.mark.timeout(300)

S, N = 8, 6
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(10 + i)
        labels = torch.randint(0, CONFIG["vocab_size"], (S,), generator=g)
        labels[i % S] = -100
        return {"input_ids": torch.randint(0, CONFIG["vocab_size"], (S,), generator=g), "labels": labels,
                "position_ids": torch.arange(S), "source": f"sample-{i}"}


def _loader(rank: int, world: int):
    from torch.utils.data import DataLoader, DistributedSampler
    return DataLoader(_Samples(), batch_size=1, sampler=DistributedSampler(_Samples(), world, rank, shuffle=False))


def _epoch(adapter) -> list[dict]:
    out = []
    while True:
        try:
            out.append(next(adapter))
        except StopIteration:
            return out


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).float()
    return model


def _compare_ranks():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = init_dist()
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp as theirs
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zerotrain.deepspeed.runtime.sequence_parallel import ulysses_sp as ours

    deepspeed.init_distributed(dist_backend="gloo")
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    out = {}
    for name, lib in (("deepspeed", theirs), ("zerotrain", ours)):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa  # each registration wraps the plain SDPA
        model = _llama()
        mpu = lib.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length=S,
                                                                   seq_length_is_variable=True)
        group = mpu.get_sequence_parallel_group()
        adapter = lib.UlyssesSPDataLoaderAdapter(_loader(rank, world), mpu.get_sequence_parallel_rank(), group,
                                                 mpu.get_sequence_parallel_world_size(), torch.device("cpu"))
        length = len(adapter)
        micro = _epoch(adapter)
        again = next(adapter)  # after the end of an epoch, the next one starts
        first = micro[0]
        logits = model(input_ids=first["input_ids"], position_ids=first["position_ids"]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), first["shift_labels"].reshape(-1),
                               ignore_index=-100, reduction="sum")
        loss.backward()
        out[name] = {"len": length, "micro": micro, "again": again, "loss": loss.detach(),
                     "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                     "sp": (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(),
                            dist.get_process_group_ranks(group))}
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    return out


def test_alst_faces_equal_deepspeeds(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    for rank, got in enumerate(run_ranks("test_ulysses_alst:_compare_ranks", 2, tmp_path, timeout=280)):
        ds, zt = got["deepspeed"], got["zerotrain"]
        assert ds["sp"] == zt["sp"] == (2, rank, [0, 1])
        assert ds["len"] == zt["len"] == N and len(ds["micro"]) == len(zt["micro"]) == N
        for i, (a, b) in enumerate(zip(ds["micro"] + [ds["again"]], zt["micro"] + [zt["again"]])):
            assert list(a) == list(b), (rank, i)
            for k in a:
                same = torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                assert same, (rank, i, k)
        assert torch.allclose(ds["loss"], zt["loss"], rtol=1e-4, atol=0)
        for n, g in ds["grads"].items():
            err = ((zt["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)).item()
            assert err <= 1e-4, (rank, n, err)
