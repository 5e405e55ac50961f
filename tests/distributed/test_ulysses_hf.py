"""Ulysses on a Hugging Face Llama (strategies/parallel/hf.py, issue 45): a tiny ``LlamaConfig``
model (GQA: 4 query heads, 2 KV heads; rotary positions) switched to the Ulysses attention
implementation with ``use_ulysses``; each of 2 ranks runs its half of every sequence with its own
``position_ids`` and its token sum of the loss / all tokens; the summed loss and parameter
gradients equal the whole sequence through transformers' own SDPA attention on one process.

# tolerance: a forward-error bound (tests/tolerance.py) over the longest chain of fp32 sums an
# element passes through: per layer the q/k/v/o projections (width), the MLP (width + intermediate),
# the attention's dot product and two S-term sums; then the head (width) and the B*S-token sum.
Skips without transformers (not a dependency of zerotrain).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import init_dist, run_ranks
from test_ulysses import assert_same_step, summed_step
from tolerance import sum_rtol

pytestmark = pytest.mark.timeout(300)

B, S = 2, 16
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


def _model_and_batch(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation=attn)).float()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, S + 1), generator=g)
    return model, ids[:, :-1], ids[:, 1:]


def _loss_sum(model, ids, targets, positions, attention_mask=None) -> torch.Tensor:
    logits = model(input_ids=ids, position_ids=positions.expand(ids.shape[0], -1), attention_mask=attention_mask).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


def _bound() -> float:
    c = CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    per_layer = 4 * c["hidden_size"] + c["hidden_size"] + c["intermediate_size"] + head_dim + 2 * S
    return 2 * sum_rtol(c["num_hidden_layers"] * per_layer + c["hidden_size"] + B * S)


def _padded(ids, targets):
    """Row 0 right-padded (its last 5 tokens), row 1 left-padded (its first 3): the padding mask, and
    the targets with the padded positions ignored (-100)."""
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    mask[1, :3] = 0
    return mask, targets.masked_fill(mask == 0, -100)


def _step(padded: bool, shard: int = 0, parts: int = 1, model_hook=None) -> tuple:
    """The model, and its loss over columns ``shard`` of ``parts`` of the batch (the token sum / the
    whole batch's token count), with or without the padding of ``_padded``."""
    model, ids, targets = _model_and_batch("sdpa")
    mask = None
    if padded:
        mask, targets = _padded(ids, targets)
    if model_hook is not None:
        model_hook(model)
    count = int((targets != -100).sum())
    s = S // parts
    cols = slice(shard * s, (shard + 1) * s)
    cut = None if mask is None else mask[:, cols]
    return model, _loss_sum(model, ids[:, cols], targets[:, cols], torch.arange(cols.start, cols.stop), cut) / count


def _ranks():
    from zerotrain.strategies.parallel import use_ulysses

    rank, world = init_dist()
    out = {}
    for padded in (False, True):
        model, loss = _step(padded, rank, world, lambda m: use_ulysses(m, dist.group.WORLD))
        out[padded] = summed_step(model, loss)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list:
    """Both steps of both ranks, from one 2-process run."""
    pytest.importorskip("transformers")
    return run_ranks("test_ulysses_hf:_ranks", 2, tmp_path_factory.mktemp("ulysses_hf"), timeout=240)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_llama_step_over_sequence_shards_equals_one_process(padded, ranks):
    """Without padding, and with a padding attention_mask (one row padded on the right, one on the
    left), which reaches every shard's attention as the whole sequence's mask: the step equals
    transformers' SDPA on one process with the same mask (dropping the mask, the shards attend to
    the padding and differ)."""
    model, loss = _step(padded)
    loss.backward()
    assert_same_step([r[padded] for r in ranks], loss, {n: p.grad for n, p in model.named_parameters()}, _bound())

