"""ZeRO++'s quantized communication: block-wise int8 on the wire (``zerotrain.ops.quantize``:
one fp32 scale per ``block_size`` elements, so 1 + 4/block bytes per element).

* qwZ (:meth:`Quantization.gather`, zero3's ``quantize_weights``): each rank quantizes its working
  shard; the int8 codes and the scales are all-gathered (two ``all_gather_into_tensor``); on arrival
  every rank's piece is dequantized into the gathered flat buffer. Every rank (the shard's owner
  too) computes with the same dequantized values; the masters never see the rounding.
* qgZ (:meth:`Quantization.reduce`, ``quantize_gradients``): each rank quantizes, per owner, the
  owner's piece of a gradient bucket (blocks never straddle two owners' pieces); one all-to-all
  of the codes and one of the scales give each owner every rank's int8 copy of its own piece,
  which it dequantizes and sums in fp32, in rank order.

Both return what the in-flight layer (``inflight.py``) files: the handles, the buffers to keep
alive until they are waited, and the work to do on arrival.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...ops.quantize import dequantize_blockwise, num_blocks, quantize_blockwise
from .comm import Handle, all_gather_into, all_to_all, world_size

Launched = tuple[tuple[Handle, ...], tuple[torch.Tensor, ...], Callable[[], torch.Tensor]]


@dataclass(frozen=True)
class Quantization:
    """Which collectives go as int8 (``weights``: zero3's unit gathers; ``gradients``: the
    gradient reductions) and the block size."""

    weights: bool = False
    gradients: bool = False
    block_size: int = 256

    def gather(self, full: torch.Tensor, mine: torch.Tensor, group: object = None) -> Launched:
        """Launch qwZ: ``full`` (``world`` equal pieces, rank order) receives every rank's ``mine``
        through int8; the returned work dequantizes into ``full`` and returns it."""
        part, block = mine.numel(), self.block_size
        world = world_size(group)
        nb = num_blocks(part, block)
        q_mine, s_mine = quantize_blockwise(mine, block)
        q_all = torch.empty(world * part, dtype=torch.int8, device=mine.device)
        s_all = torch.empty(world * nb, dtype=torch.float32, device=mine.device)
        handles = (all_gather_into(q_all, q_mine, group), all_gather_into(s_all, s_mine, group))

        def arrive() -> torch.Tensor:
            for r in range(world):
                dequantize_blockwise(q_all[r * part:(r + 1) * part], s_all[r * nb:(r + 1) * nb], block,
                                     out=full[r * part:(r + 1) * part])
            return full

        return handles, (q_mine, s_mine, q_all, s_all), arrive

    def reduce(self, flat: torch.Tensor, pieces: Sequence[tuple[int, int]], rank: int,
               group: object = None) -> Launched:
        """Launch qgZ: ``pieces[r]`` = (offset, numel) of rank r's piece of ``flat`` (in rank
        order; numel 0 for a rank that owns none). The returned work gives the sum over ranks of
        this rank's piece, in fp32."""
        block, world = self.block_size, len(pieces)
        sizes = [n for _, n in pieces]
        blocks = [num_blocks(n, block) for n in sizes]
        q_in = torch.empty(sum(sizes), dtype=torch.int8, device=flat.device)
        s_in = torch.empty(sum(blocks), dtype=torch.float32, device=flat.device)
        qo = so = 0
        for (off, n), nb in zip(pieces, blocks):
            quantize_blockwise(flat[off:off + n], block, q=q_in[qo:qo + n], scales=s_in[so:so + nb])
            qo, so = qo + n, so + nb
        m, mb = sizes[rank], blocks[rank]
        q_out = torch.empty(world * m, dtype=torch.int8, device=flat.device)
        s_out = torch.empty(world * mb, dtype=torch.float32, device=flat.device)
        handles = (all_to_all(q_out, q_in, [m] * world, sizes, group),
                   all_to_all(s_out, s_in, [mb] * world, blocks, group))

        def arrive() -> torch.Tensor:
            total = torch.zeros(m, dtype=torch.float32, device=flat.device)
            one = torch.empty_like(total)
            for r in range(world):
                total.add_(dequantize_blockwise(q_out[r * m:(r + 1) * m], s_out[r * mb:(r + 1) * mb], block,
                                                out=one))
            return total

        return handles, (q_in, s_in, q_out, s_out), arrive


def wire_bytes(sizes: Sequence[int], block_size: int) -> int:
    """Bytes of pieces of ``sizes`` elements as int8 codes plus their fp32 scales (the messages
    of one quantized gather or reduction, as the CommsLogger counts them)."""
    return sum(sizes) + 4 * sum(num_blocks(n, block_size) for n in sizes)


def exact_gather(full: torch.Tensor, mine: torch.Tensor, group: object = None) -> Launched:
    """The plain all-gather, in :meth:`Quantization.gather`'s shape."""
    return (all_gather_into(full, mine, group),), (mine,), lambda: full
