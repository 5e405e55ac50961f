"""The demo GPT (examples/gpt.py) under Ulysses (issue 45): ``GPT.use_attention`` with
``ulysses_attention`` over 2 ranks, each running its half of every sequence with its own
``positions`` and its token sum of the loss / all tokens: the summed loss and parameter gradients
equal the plain model over the whole sequence on one process; without ``use_attention`` the model
computes what it did before the hook existed (the same SDPA call).

# tolerance: a forward-error bound (tests/tolerance.py) over the longest chain of fp32 sums an
# element passes through: per layer c_attn/c_proj (n_embd), the MLP (n_embd + 4 n_embd), the
# attention's dot product and two S-term sums; then lm_head (n_embd) and the B*S-token sum.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import init_dist, run_ranks
from test_ulysses import assert_same_step, summed_step
from tolerance import sum_rtol
from zerotrain.examples.gpt import GPT, GPTConfig

pytestmark = pytest.mark.timeout(240)

B, S = 2, 16
CONFIG = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=4, n_embd=16)


def _model_and_batch():
    torch.manual_seed(5)
    model = GPT(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(6))
    return model, ids[:, :-1], ids[:, 1:]


def _loss_sum(model, ids, targets, positions=None):
    logits, _ = model(ids, positions=positions)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def _shard_loss():
    """On a rank: the model attending through Ulysses over all ranks, and a function giving the
    token sum of the loss on this rank's half of every sequence, at its own positions."""
    from zerotrain.strategies.parallel import ulysses_attention

    rank, world = init_dist()
    model, ids, targets = _model_and_batch()
    model.use_attention(lambda q, k, v: ulysses_attention(q, k, v, dist.group.WORLD))
    s = S // world
    cols = slice(rank * s, (rank + 1) * s)
    return model, lambda: _loss_sum(model, ids[:, cols], targets[:, cols], torch.arange(cols.start, cols.stop))


def _ranks():
    model, loss_sum = _shard_loss()
    return summed_step(model, loss_sum() / (B * S))


def test_demo_gpt_step_over_sequence_shards_equals_one_process(tmp_path):
    ranks = run_ranks("test_ulysses_gpt:_ranks", 2, tmp_path)
    model, ids, targets = _model_and_batch()
    loss = _loss_sum(model, ids, targets) / (B * S)
    loss.backward()
    c = CONFIG
    per_layer = 2 * c.n_embd + 5 * c.n_embd + c.n_embd // c.n_head + 2 * S
    bound = 2 * sum_rtol(c.n_layer * per_layer + c.n_embd + B * S)
    assert_same_step(ranks, loss, {n: p.grad for n, p in model.named_parameters()}, bound)


def test_without_the_hook_the_model_is_unchanged():
    model, ids, _ = _model_and_batch()
    plain, _ = model(ids)
    model.use_attention(lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2))
    hooked, _ = model(ids)
    model.use_attention(None)
    assert torch.equal(plain, hooked) and torch.equal(model(ids)[0], plain)
    assert torch.equal(model(ids, positions=torch.arange(S))[0], plain)
    with pytest.raises(ValueError, match="sequence length 33 exceeds GPTConfig.block_size=32"):
        model(ids, positions=torch.arange(17, 17 + S))


def _saved_activation_bytes(model, run) -> int:
    """Bytes of the tensors autograd saves for backward while ``run()`` builds the graph, parameters
    and 0-dim scalars (a fixed few bytes per graph) excluded, each tensor once (its own elements: a
    slice of the batch counts as the slice)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        if t.dim() and t.untyped_storage().data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape), t.stride())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _memory_ranks():
    model, loss_sum = _shard_loss()
    return _saved_activation_bytes(model, loss_sum)


def test_sp2_halves_the_saved_activations(tmp_path):
    """The issue's formula: at a fixed sequence length, sp=2 halves each rank's activations (the
    projections hold S/2 tokens, the attention H/2 heads of all S): exactly, tensor by tensor."""
    model, ids, targets = _model_and_batch()
    whole = _saved_activation_bytes(model, lambda: _loss_sum(model, ids, targets))
    per_rank = run_ranks("test_ulysses_gpt:_memory_ranks", 2, tmp_path)
    assert all(b == whole // 2 for b in per_rank), (whole, per_rank)
