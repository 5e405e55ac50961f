"""Ulysses for Hugging Face ``transformers`` models through their attention-implementation hook:
``use_ulysses(model, group)`` registers an attention function (``AttentionInterface``) that runs
``ulysses_attention`` on the model's q, k, v and a mask function (``AttentionMaskInterface``), and
switches the model to them. Each rank then calls the model on its sequence shard with that shard's
own ``position_ids`` (rotary embeddings come out right), and computes the loss on the shard.

Masks: transformers asks the mask function for a shard-sized mask. Without a padding
``attention_mask`` (or with one that is all ones over the whole group) it returns None and the
attention is causal over the whole sequence (SDPA's ``is_causal``). With padding, every rank
all-gathers the group's 2-D ``attention_mask`` shards (``[B, S/sp]`` -> ``[B, S]``, a few bytes per
token) and builds, with transformers' own ``sdpa_mask``, the ``[B, 1, S, S]`` boolean mask the
unsharded model would build; the attention, which sees every token of its heads, applies it. So a
padded batch (left or right) gives the unsharded model's numbers; the mask costs S*S bytes per
sequence, as it does without Ulysses.

Refused rather than wrong: a 4-D custom mask or a flex ``BlockMask`` handed to the model (a shard
cannot say what it means for the other shards' queries), a KV cache, ``output_attentions``. Packed
sequences (position ids that restart inside a row) are not detected: pass one document per row.

``transformers`` is imported only when ``use_ulysses`` runs; zerotrain does not depend on it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .tensor import _seq_gather
from .ulysses import ulysses_attention


def _attention_for(group):
    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if kwargs.get("output_attentions"):
            raise NotImplementedError("Ulysses attention: output_attentions=True is not supported")
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
                                           or attention_mask.shape[-1] != query.shape[2] * dist.get_world_size(group)):
            raise NotImplementedError("Ulysses attention: the attention got a mask that does not cover the whole "
                                      "sequence; only the mask use_ulysses builds (from a 2-D padding "
                                      "attention_mask) or none is supported")

        def local(q, k, v):  # [B, S, heads, D] -> SDPA's [B, heads, S, D] and back
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout,
                                                 is_causal=attention_mask is None, scale=scaling,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            return out.transpose(1, 2)

        # transformers hands [B, heads, S/sp, D] and takes [B, S/sp, heads, D] back
        out = ulysses_attention(*(t.transpose(1, 2) for t in (query, key, value)), group, attention=local)
        return out, None

    return attention


def _mask_for(group):
    def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
        from transformers.masking_utils import causal_mask_function, sdpa_mask

        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise NotImplementedError("Ulysses attention: a 4-D or block attention_mask is not supported; pass a "
                                      "2-D padding attention_mask [batch, sequence shard] (or none)")
        if q_offset or kv_offset:
            raise NotImplementedError("Ulysses attention: a KV cache (offset positions) is not supported")
        whole = _seq_gather(attention_mask.to(torch.uint8), group).bool()  # [B, S/sp] shards -> [B, S]
        if bool(whole.all()):
            return None
        sp = dist.get_world_size(group)
        return sdpa_mask(batch_size=batch_size, q_length=q_length * sp, kv_length=kv_length * sp,
                         mask_function=mask_function or causal_mask_function, attention_mask=whole,
                         allow_is_causal_skip=False, device=attention_mask.device)

    return mask


def use_ulysses(model, group, name: str | None = None) -> str:
    """Make ``model`` (a ``transformers`` PreTrainedModel) attend through Ulysses over ``group``;
    returns the attention implementation's registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False  # a KV cache of a shard's keys is not the sequence's
    name = name or f"zerotrain_ulysses_{id(group)}"
    AttentionInterface.register(name, _attention_for(group))
    AttentionMaskInterface.register(name, _mask_for(group))
    model.set_attn_implementation(name)
    return name
