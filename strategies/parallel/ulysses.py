"""Ulysses sequence parallelism (Jacobs et al., 2023): each rank of a sequence group holds a
contiguous shard of the sequence, ``[B, S/sp, H, D]``; an all-to-all turns the shards of q, k and v
into head shards, ``[B, S, H/sp, D]``, so any local attention sees the whole sequence for its heads
(causal masks, softmax over all keys: unchanged), and a second all-to-all turns the output back.

The exchanges are all-to-alls whose backward is the opposite all-to-all (``_Exchange``), so
gradients reach every rank's shard; each, forward and backward, is reported to ``instrument``
(the comms logger files it under the group's name: "sequence" for a strategy mesh's).

Layout: the sequence is dimension 1 and the heads dimension 2 (batch first, as
``[B, S, H, D]``); rank i of the group holds tokens ``[i*S/sp, (i+1)*S/sp)`` and, between the
exchanges, heads ``[i*H/sp, (i+1)*H/sp)``.

GQA: the KV heads follow the query heads in groups (query head j attends with KV head
``j // (H / Hkv)``). Where ``Hkv`` does not divide ``sp``, ``repeat_kv_for`` repeats each KV head
(``repeat_interleave``, whose backward sums the copies) the fewest times that make the count divide
``sp`` and still divide ``H``, so each rank's query heads find their KV head on the same rank.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import instrument


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)
    with instrument.blocking("all_to_all", chunks, group):
        dist.all_to_all_single(out, chunks, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """An all-to-all forward; the same all-to-all of the gradient backward (the exchange is its
    own inverse: chunk j of the result came from rank j, and goes back there)."""

    @staticmethod
    def forward(ctx, chunks: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(chunks, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _exchange(chunks: torch.Tensor, group) -> torch.Tensor:
    """All-to-all along dim 0 of ``chunks`` ([sp, ...]): chunk j goes to rank j; the result's
    chunk j came from rank j. Differentiable."""
    return _Exchange.apply(chunks, group)


def _size(group) -> int:
    return dist.get_world_size(group)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S/sp, H, D]`` (this rank's tokens, all heads) -> ``[B, S, H/sp, D]`` (all tokens, this
    rank's heads)."""
    sp = _size(group)
    b, s, h, d = x.shape
    if h % sp:
        raise ValueError(f"sequence_to_heads: {h} heads do not divide over a sequence group of {sp}; "
                         f"valid: a multiple of {sp} (for KV heads: repeat_kv_for)")
    chunks = x.reshape(b, s, sp, h // sp, d).permute(2, 0, 1, 3, 4)  # [sp, B, s, H/sp, D]: rank j's heads
    got = _exchange(chunks, group)  # [sp, B, s, H/sp, D]: rank j's tokens of my heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, sp * s, h // sp, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, H/sp, D]`` -> ``[B, S/sp, H, D]``: the inverse of ``sequence_to_heads``."""
    sp = _size(group)
    b, s_all, h, d = x.shape
    if s_all % sp:
        raise ValueError(f"heads_to_sequence: sequence length {s_all} does not divide over {sp} ranks")
    s = s_all // sp
    chunks = x.reshape(b, sp, s, h, d).permute(1, 0, 2, 3, 4)  # [sp, B, s, H/sp, D]: rank j's tokens
    got = _exchange(chunks, group)  # [sp, B, s, H/sp, D]: my tokens of rank j's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, sp * h, d)


def repeat_kv_for(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times each KV head must be repeated for ``num_heads`` query heads and
    ``num_kv_heads`` KV heads to split over ``sp`` ranks with every query head's KV head on its rank
    (1: none). Raises ValueError where the query heads do not divide over ``sp`` or the KV heads do
    not divide the query heads."""
    if num_heads % sp:
        raise ValueError(f"Ulysses: {num_heads} query heads do not divide over a sequence group of {sp}; "
                         f"valid: a multiple of {sp}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"Ulysses: {num_kv_heads} KV heads for {num_heads} query heads; valid: a divisor of "
                         f"{num_heads}")
    # num_kv_heads * repeat = lcm(num_kv_heads, sp), which divides num_heads (a multiple of both)
    return sp // math.gcd(num_kv_heads, sp)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled-dot-product attention on ``[B, S, H, D]`` tensors (KV heads may be fewer: each
    serves ``H / Hkv`` consecutive query heads)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                      attention: Callable[..., torch.Tensor] = causal_sdpa, **kwargs) -> torch.Tensor:
    """``attention(q, k, v, **kwargs)`` over the whole sequence for this rank's heads, from and
    back to sequence shards: q ``[B, S/sp, H, D]``, k and v ``[B, S/sp, Hkv, D]`` -> ``[B, S/sp, H, D]``.
    ``attention`` takes and returns ``[B, S, heads, D]`` (it may see fewer KV heads than query
    heads, as GQA)."""
    sp = _size(group)
    repeat = repeat_kv_for(q.shape[2], k.shape[2], sp)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    return heads_to_sequence(attention(q, k, v, **kwargs), group)
