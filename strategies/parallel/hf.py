"""Ulysses for Hugging Face ``transformers`` models through their attention-implementation hook:
``use_ulysses(model, group)`` registers an attention function (``AttentionInterface``) that runs
``ulysses_attention`` on the model's q, k, v and a mask function (``AttentionMaskInterface``) that
builds no shard-sized mask (the attention is causal over the whole sequence), and switches the model
to them. Each rank then calls the model on its sequence shard with that shard's own
``position_ids`` (rotary embeddings come out right), and computes the loss on the shard.

Refused rather than wrong: a padding ``attention_mask`` with zeros (the shard's mask cannot say what
the other shards' keys are), a KV cache, ``output_attentions``. Packed sequences (position ids that
restart inside a row) are not detected: pass one document per row.

``transformers`` is imported only when ``use_ulysses`` runs; zerotrain does not depend on it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ulysses import ulysses_attention


def _attention_for(group):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("Ulysses attention: an attention mask reached the attention; only causal "
                                      "attention over the whole sequence is supported")
        if kwargs.get("output_attentions"):
            raise NotImplementedError("Ulysses attention: output_attentions=True is not supported")

        def local(q, k, v):  # [B, S, heads, D] -> SDPA's [B, heads, S, D] and back
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out.transpose(1, 2)

        # transformers hands [B, heads, S/sp, D] and takes [B, S/sp, heads, D] back
        out = ulysses_attention(*(t.transpose(1, 2) for t in (query, key, value)), group, attention=local)
        return out, None

    return attention


def _no_shard_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("Ulysses attention: a padding attention_mask with zeros is not supported; "
                                  "pass unpadded rows (or no attention_mask)")
    return None


def use_ulysses(model, group, name: str | None = None) -> str:
    """Make ``model`` (a ``transformers`` PreTrainedModel) attend through Ulysses over ``group``;
    returns the attention implementation's registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache of a shard's keys is not the sequence's
    name = name or f"zerotrain_ulysses_{id(group)}"
    AttentionInterface.register(name, _attention_for(group))
    AttentionMaskInterface.register(name, _no_shard_mask)
    model.set_attn_implementation(name)
    return name
