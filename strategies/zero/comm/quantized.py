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
alive until they are waited, and the work to do on arrival. The int8 codes, the scales and the
dequantized pieces come from :attr:`Quantization.pool` and go back to it in that work, so a step
allocates (and page-faults) none of them afresh; qgZ's sum goes where the caller says (zero3: the
gradient partition itself while it is zeros; zero2: this rank's piece of an fp32 bucket).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ....ops.quantize import dequantize_blockwise, num_blocks, quantize_blockwise
from .collectives import Handle, SizedPool, all_gather_into, all_to_all, world_size

Launched = tuple[tuple[Handle, ...], tuple[torch.Tensor, ...], Callable[[], torch.Tensor]]


@dataclass(frozen=True)
class Quantization:
    """Which collectives go as int8 (``weights``: zero3's unit gathers; ``gradients``: the
    gradient reductions) and the block size."""

    weights: bool = False
    gradients: bool = False
    block_size: int = 256
    #: the int8 codes, scales and dequantized pieces of the collectives in flight, kept for the
    #: next collective of the same shape (one pool per strategy; not part of the options)
    pool: SizedPool = field(default_factory=SizedPool, compare=False, repr=False)

    def gather(self, full: torch.Tensor, mine: torch.Tensor, group: object = None) -> Launched:
        """Launch qwZ: ``full`` (``world`` equal pieces, rank order) receives every rank's ``mine``
        through int8; the returned work dequantizes into ``full`` and returns it."""
        part, block, pool, dev = mine.numel(), self.block_size, self.pool, mine.device
        world = world_size(group)
        nb = num_blocks(part, block)
        q_mine, s_mine = quantize_blockwise(mine, block, q=pool.take(part, torch.int8, dev),
                                            scales=pool.take(nb, torch.float32, dev))
        q_all, s_all = pool.take(world * part, torch.int8, dev), pool.take(world * nb, torch.float32, dev)
        handles = (all_gather_into(q_all, q_mine, group), all_gather_into(s_all, s_mine, group))

        def arrive() -> torch.Tensor:
            for r in range(world):
                dequantize_blockwise(q_all[r * part:(r + 1) * part], s_all[r * nb:(r + 1) * nb], block,
                                     out=full[r * part:(r + 1) * part])
            pool.give(q_mine, s_mine, q_all, s_all)
            return full

        return handles, (q_mine, s_mine, q_all, s_all), arrive

    def reduce(self, flat: torch.Tensor, pieces: Sequence[tuple[int, int]], rank: int,
               group: object = None, out: Optional[torch.Tensor] = None) -> Launched:
        """Launch qgZ: ``pieces[r]`` = (offset, numel) of rank r's piece of ``flat`` (in rank
        order; numel 0 for a rank that owns none). The returned work gives the sum over ranks of
        this rank's piece, in fp32: in ``out`` (fp32, that piece's size; it may be ``flat``'s own
        piece, which is read only here, at launch), else in a new tensor. Call the work once the
        handles completed, also on a rank that owns nothing: it gives the pooled buffers back."""
        block, world, pool, dev = self.block_size, len(pieces), self.pool, flat.device
        sizes = [n for _, n in pieces]
        blocks = [num_blocks(n, block) for n in sizes]
        m, mb = sizes[rank], blocks[rank]
        if out is not None and (out.dtype != torch.float32 or out.numel() != m):
            raise ValueError(f"qgZ: out has {out.numel()} {out.dtype} elements; valid: {m} torch.float32")
        q_in, s_in = pool.take(sum(sizes), torch.int8, dev), pool.take(sum(blocks), torch.float32, dev)
        qo = so = 0
        for (off, n), nb in zip(pieces, blocks):
            quantize_blockwise(flat[off:off + n], block, q=q_in[qo:qo + n], scales=s_in[so:so + nb])
            qo, so = qo + n, so + nb
        q_out, s_out = pool.take(world * m, torch.int8, dev), pool.take(world * mb, torch.float32, dev)
        handles = (all_to_all(q_out, q_in, [m] * world, sizes, group),
                   all_to_all(s_out, s_in, [mb] * world, blocks, group))

        def arrive() -> torch.Tensor:
            # rank 0's copy straight into the sum, the others added in rank order through one
            # pooled piece (bit for bit the sum 0 + x0 + x1 + ... in fp32)
            total = torch.empty(m, dtype=torch.float32, device=dev) if out is None else out
            dequantize_blockwise(q_out[:m], s_out[:mb], block, out=total)
            if world > 1:
                one = pool.take(m, torch.float32, dev)
                for r in range(1, world):
                    total.add_(dequantize_blockwise(q_out[r * m:(r + 1) * m], s_out[r * mb:(r + 1) * mb], block,
                                                    out=one))
                pool.give(one)
            pool.give(q_in, s_in, q_out, s_out)
            return total

        return handles, (q_in, s_in, q_out, s_out), arrive


def wire_bytes(sizes: Sequence[int], block_size: int) -> int:
    """Bytes of pieces of ``sizes`` elements as int8 codes plus their fp32 scales (the messages
    of one quantized gather or reduction, as the CommsLogger counts them)."""
    return sum(sizes) + 4 * sum(num_blocks(n, block_size) for n in sizes)


def exact_gather(full: torch.Tensor, mine: torch.Tensor, group: object = None) -> Launched:
    """The plain all-gather, in :meth:`Quantization.gather`'s shape."""
    return (all_gather_into(full, mine, group),), (mine,), lambda: full
