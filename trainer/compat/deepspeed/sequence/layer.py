"""``deepspeed.sequence.layer.DistributedAttention`` with DeepSpeed 0.19.8's signature and layouts,
on zerotrain's Ulysses exchanges (``strategies/parallel/ulysses.py``).

``DistributedAttention(local_attention, sequence_process_group, scatter_idx=2, gather_idx=0,
sp_stream=None, num_kv_heads=None)``; ``forward(query, key, value, batch_dim_idx,
rotary_pos_emb=None, *args, **kwargs)``. Each rank passes its sequence shard, batch first
(``batch_dim_idx=0``: ``[B, S/sp, H, D]``) or sequence first (``1``: ``[S/sp, B, H, D]``);
``local_attention(q, k, v, *args, **kwargs)`` gets the whole sequence for this rank's heads in the
same layout (``[B, S, H/sp, D]`` or ``[S, B, H/sp, D]``) and returns its output so; the result is
the sequence shard again, all heads.

Where DeepSpeed differs:
- KV heads that do not divide the group: DeepSpeed splits the heads unevenly over the ranks (and
  refuses fewer KV heads than ranks); here each KV head is repeated until they divide
  (``repeat_kv_for``), so the local attention sees the same heads on every rank. Attention is per
  head, so the result is the same where DeepSpeed runs.
- ``sp_stream`` (CUDA-stream overlap of the exchanges) and ``rotary_pos_emb`` (RoPE applied between
  the exchanges) are not supported: a clear NotImplementedError, not a silent difference.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .....strategies.parallel.ulysses import ulysses_attention


class DistributedAttention(nn.Module):
    def __init__(self, local_attention: nn.Module, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise NotImplementedError(f"DistributedAttention: scatter_idx={scatter_idx}, gather_idx={gather_idx}; "
                                      "supported: scatter_idx=2 (heads) with gather_idx 0 or 1 (the sequence, "
                                      "as batch_dim_idx says)")
        if sp_stream is not None:
            raise NotImplementedError("DistributedAttention: sp_stream (overlapping the all-to-alls on a CUDA "
                                      "stream) is not supported; pass sp_stream=None")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = None
        self.sp_overlap_comm = False
        self.overlap_handles = None

    def layer_sync(self, layer) -> None:
        """DeepSpeed's stream synchronisation hook; nothing to wait for without ``sp_stream``."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention.forward: batch_dim_idx={batch_dim_idx!r}; valid: 0 "
                             "([B, S, H, D]) or 1 ([S, B, H, D])")
        if rotary_pos_emb is not None:
            raise NotImplementedError("DistributedAttention.forward: rotary_pos_emb is not supported; apply "
                                      "the rotary embedding in local_attention (it sees the whole sequence)")
        seq_first = batch_dim_idx == 1

        def local(q, k, v):
            if seq_first:  # back to the caller's layout for its attention, and batch first again
                q, k, v = (t.transpose(0, 1) for t in (q, k, v))
                return self.local_attn(q, k, v, *args, **kwargs).transpose(0, 1)
            return self.local_attn(q, k, v, *args, **kwargs)

        if seq_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        out = ulysses_attention(query, key, value, self.spg, attention=local)
        return out.transpose(0, 1).contiguous() if seq_first else out
