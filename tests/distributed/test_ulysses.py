"""Ulysses sequence parallelism (strategies/parallel/ulysses.py, issue 45) on real gloo processes,
against the whole sequence on one process (fp32):

* causal attention over sequence shards (MHA, GQA, and KV heads that must be repeated to divide the
  group; sp=2 and sp=4), and attention with a whole-sequence mask (two packed documents) passed
  through: the outputs and the gradients of q, k, v equal single-process SDPA over the whole sequence;
* DeepSpeed's face, ``zerotrain.deepspeed.sequence.layer.DistributedAttention``, batch first and
  sequence first, equals the same;
* one training step of a tiny GPT-like block stack with the sequence split over sp=2 (position ids
  and the loss on the shards, loss = the mean over all tokens: each rank's token sum / all tokens,
  summed over ranks) gives the loss and parameter gradients of the whole sequence on one process;
  also dp=2 x sp=2 on 4 ranks, whose mesh groups (init_device_mesh) are checked there too.

# tolerance: a forward-error bound (tests/tolerance.py): every compared element is reached through
# a chain of fp32 sums whose length we count (attention: the D-term dot product, the S-term softmax
# sum and the S-term weighted sum; the model: per layer the width-long projections, 4x width MLP, the
# attention's sums, then the B*S-token loss or gradient sum); two valid orders of the same sums
# differ by at most 2 * sum_rtol(that length), norm-wise relative.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import init_dist, run_ranks, run_ranks_once
from tolerance import rel_err, sum_rtol
from zerotrain.strategies.parallel import ParallelMesh, ulysses_attention
from zerotrain.strategies.parallel.ulysses import causal_sdpa

pytestmark = pytest.mark.timeout(240)

B, S, D = 2, 8, 4
# (query heads, KV heads): MHA; GQA that divides sp=2; one KV head, repeated to 2; 3 KV heads, each
# repeated twice (repeat_interleave: a query head keeps its own group, which tiling would tear)
HEADS = [(4, 4), (4, 2), (4, 1), (6, 3)]
# on sp=4: 2 KV heads each repeated twice for 8 query heads (4 KV heads, 2 query heads per rank)
HEADS_SP4 = [(4, 4), (8, 2), (4, 1)]


def _qkv(h: int, hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 10 * h + hkv)
    return [torch.randn(B, S, n, D, generator=g) for n in (h, hkv, hkv)]


def _document_mask() -> torch.Tensor:
    """Causal within two packed documents, tokens [0, 3) and [3, S): the boundary is not the shards'."""
    doc = (torch.arange(S) >= 3).long()
    return torch.ones(S, S, dtype=torch.bool).tril() & (doc[:, None] == doc[None, :])


def masked_sdpa(q, k, v, mask):
    """SDPA with a whole-sequence boolean mask ([S, S]) on [B, S, H, D] tensors (KV heads equal)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _attention_bound() -> float:
    return 2 * sum_rtol(D + 2 * S + 3)  # dot product, softmax sum, weighted sum, max/exp/div


# ---------------------------------------------------------------------------- ranks
def _shard(t: torch.Tensor, index: int, parts: int, dim: int = 1) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index].contiguous()


def _attention_ranks(face: str):
    rank, world = init_dist()
    group = dist.group.WORLD
    out = {}
    for h, hkv in HEADS if world == 2 else HEADS_SP4:
        full = _qkv(h, hkv)
        shards = [_shard(t, rank, world).requires_grad_() for t in full]
        if face == "ours":
            y = ulysses_attention(*shards, group)
        else:
            from zerotrain.deepspeed.sequence.layer import DistributedAttention
            if face == "deepspeed_seq_first":  # [S/sp, B, H, D], local attention in the same layout
                attn = DistributedAttention(lambda q, k, v: causal_sdpa(*(t.transpose(0, 1) for t in (q, k, v)))
                                            .transpose(0, 1), group)
                y = attn(*(t.transpose(0, 1) for t in shards), batch_dim_idx=1).transpose(0, 1)
            else:
                y = DistributedAttention(causal_sdpa, group)(*shards, batch_dim_idx=0)
        # a loss weighting every output element differently, so each gradient is checked
        w = _shard(torch.linspace(-1, 1, y.numel() * world).reshape(B, S, h, D), rank, world)
        (y * w).sum().backward()
        out[f"{h}x{hkv}"] = {"y": y.detach(), **{n: t.grad for n, t in zip("qkv", shards)}}
    if face == "ours" and world == 2:  # a mask over the whole sequence, passed through to the attention
        shards = [_shard(t, rank, world).requires_grad_() for t in _qkv(4, 4, seed=1)]
        y = ulysses_attention(*shards, group, attention=masked_sdpa, mask=_document_mask())
        (y * _shard(torch.linspace(-1, 1, y.numel() * world).reshape(B, S, 4, D), rank, world)).sum().backward()
        out["4x4 masked"] = {"y": y.detach(), **{n: t.grad for n, t in zip("qkv", shards)}}
    return out


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        b, s, width = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        x = x + self.o(attend(q, k, v).reshape(b, s, width))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, CONTEXT = 32, 16, 4, 2, 2, 16

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(self.VOCAB, self.WIDTH)
        self.pos = nn.Embedding(self.CONTEXT, self.WIDTH)
        self.blocks = nn.ModuleList(Block(self.WIDTH, self.HEADS, self.KV_HEADS) for _ in range(self.LAYERS))
        self.ln_f = nn.LayerNorm(self.WIDTH)
        self.head = nn.Linear(self.WIDTH, self.VOCAB)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.ln_f(x))


GB, GS = 4, 16  # the global batch: 4 sequences of 16 tokens


def _model_and_batch():
    torch.manual_seed(7)
    model = TinyGPT()
    g = torch.Generator().manual_seed(8)
    idx = torch.randint(0, TinyGPT.VOCAB, (GB, GS + 1), generator=g)
    return model, idx[:, :-1], idx[:, 1:]


def summed_step(model, loss: torch.Tensor) -> dict:
    """Backward of this rank's share of the mean loss, then the loss and every parameter gradient
    summed over all ranks (over sp and dp alike: each rank's loss is its token sum / all tokens)."""
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # the mean over every token of the global batch
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad
    return {"loss": total, "grads": grads}


def assert_same_step(ranks: list, loss: torch.Tensor, grads: dict, bound: float) -> None:
    """Every rank's summed loss and gradients within ``bound`` (norm-wise relative) of one process's."""
    for r in ranks:
        assert rel_err(r["loss"], loss) <= bound, (float(r["loss"]), float(loss))
        for name, g in grads.items():
            err = rel_err(r["grads"][name], g)
            assert err <= bound, f"{name}: relative error {err:.3e} > {bound:.3e}"


def _token_loss_sum(model, idx, targets, positions, attend) -> torch.Tensor:
    logits = model(idx, positions, attend)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def _step_ranks(data: int, sequence: int):
    rank, world = init_dist()
    mesh = ParallelMesh(data=data, sequence=sequence)
    where = mesh.coordinates(rank)
    sp_group = mesh.group("sequence")
    checks = {axis: dist.get_process_group_ranks(mesh.group(axis)) for axis in ("data", "sequence")}
    model, idx, targets = _model_and_batch()
    rows = slice(where["data"] * GB // data, (where["data"] + 1) * GB // data)
    s = GS // sequence
    cols = slice(where["sequence"] * s, (where["sequence"] + 1) * s)
    positions = torch.arange(cols.start, cols.stop)  # this shard's own positions
    attend = (lambda q, k, v: ulysses_attention(q, k, v, sp_group)) if sequence > 1 else causal_sdpa
    loss = _token_loss_sum(model, idx[rows, cols], targets[rows, cols], positions, attend) / (GB * GS)
    return {"coords": where, "groups": checks, **summed_step(model, loss)}


# ---------------------------------------------------------------------------- the tests
def _reference_attention(heads=HEADS, masked=False):
    out = {}
    for h, hkv in heads:
        full = [t.clone().requires_grad_() for t in _qkv(h, hkv)]
        y = causal_sdpa(*full)
        (y * torch.linspace(-1, 1, y.numel()).reshape(B, S, h, D)).sum().backward()
        out[f"{h}x{hkv}"] = {"y": y.detach(), **{n: t.grad for n, t in zip("qkv", full)}}
    if masked:
        full = [t.clone().requires_grad_() for t in _qkv(4, 4, seed=1)]
        y = masked_sdpa(*full, _document_mask())
        (y * torch.linspace(-1, 1, y.numel()).reshape(B, S, 4, D)).sum().backward()
        out["4x4 masked"] = {"y": y.detach(), **{n: t.grad for n, t in zip("qkv", full)}}
    return out


_CACHE: dict = {}


@pytest.mark.parametrize("face, sp", [("ours", 2), ("deepspeed", 2), ("deepspeed_seq_first", 2), ("ours", 4)])
def test_attention_over_shards_equals_the_whole_sequence(face, sp, tmp_path_factory):
    ranks = run_ranks_once(_CACHE, (face, sp), "test_ulysses:_attention_ranks", sp, tmp_path_factory, face=face)
    want = _reference_attention(HEADS if sp == 2 else HEADS_SP4, masked=(face, sp) == ("ours", 2))
    assert set(ranks[0]) == set(want)
    for case, tensors in want.items():
        for name, w in tensors.items():
            got = torch.cat([r[case][name] for r in ranks], dim=1)
            err = rel_err(got, w)
            assert err <= _attention_bound(), f"{face} {case} {name}: relative error {err:.3e}"


def _model_bound() -> float:
    m = TinyGPT
    per_layer = 3 * m.WIDTH + 4 * m.WIDTH + D + 2 * GS  # projections, MLP, attention's sums
    return 2 * sum_rtol(m.LAYERS * per_layer + m.WIDTH + GB * GS)  # + head, + the token sum


def _reference_step():
    model, idx, targets = _model_and_batch()
    loss = _token_loss_sum(model, idx, targets, torch.arange(GS), causal_sdpa) / (GB * GS)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("data, sequence", [(1, 2), (2, 2)])
def test_training_step_over_sequence_shards_equals_one_process(data, sequence, tmp_path):
    ranks = run_ranks("test_ulysses:_step_ranks", data * sequence, tmp_path, data=data, sequence=sequence)
    mesh = ParallelMesh(data=data, sequence=sequence)
    for rank, r in enumerate(ranks):  # init_device_mesh's groups are the mesh's arithmetic
        assert r["coords"] == mesh.coordinates(rank)
        assert r["groups"] == {axis: mesh.members(axis, rank) for axis in ("data", "sequence")}
    loss, grads = _reference_step()
    assert_same_step(ranks, loss, grads, _model_bound())
