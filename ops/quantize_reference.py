"""Block-wise symmetric int8 quantization written with plain torch ops: the test oracle of
csrc/quantize/quantize.cpp and quantize.cu, and what :mod:`zerotrain.ops.quantize` runs where the
compiled op is unavailable. It runs on any device.

The definition (the kernels match it bit for bit): a flat tensor is cut into blocks of
``block_size`` elements, the last one possibly shorter; per block

* ``scale = absmax / 127`` (fp32, one IEEE division), ``q = clamp(round_half_even(x / scale),
  -127, 127)`` as int8;
* dequantized: ``q * scale`` in fp32, then rounded to nearest even into a bf16/fp16 output;
* an all-zero block: ``scale = 0``, ``q = 0``;
* a block holding an inf or a NaN: ``scale = NaN``, ``q = 0``; it dequantizes to NaN everywhere
  (non-finite values are never clipped into range: an overflow stays visible).

The round trip errs by at most ``scale / 2`` per element (plus the two roundings of the division
and the multiply, a relative 2^-23 of ``absmax``) for blocks whose scale is a normal float.
"""
from __future__ import annotations

import torch

QUANT_MAX = 127.0


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, as a (blocks, block_size) view."""
    n = flat.numel()
    nb = num_blocks(n, block_size)
    padded = flat.new_zeros(nb * block_size)
    padded[:n] = flat
    return padded.view(nb, block_size)


def quantize_reference(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape; fp32/bf16/fp16) -> (int8 codes, flat, ``x.numel()``; fp32 scales, one
    per block)."""
    blocks = _blocks(x.reshape(-1).float(), block_size)
    nonfinite = ~torch.isfinite(blocks).all(dim=1)
    absmax = blocks.abs().amax(dim=1)
    scale = absmax / torch.full_like(absmax, QUANT_MAX)  # a true division, as the kernels do
    scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    divisor = torch.where((scale == 0) | nonfinite, torch.ones_like(scale), scale)
    q = torch.round(blocks / divisor[:, None]).clamp_(-QUANT_MAX, QUANT_MAX)
    q = torch.where(nonfinite[:, None], torch.zeros_like(q), q)
    return q.to(torch.int8).reshape(-1)[:x.numel()], scale


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, block_size: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 codes and their per-block scales -> a flat tensor of ``dtype``."""
    values = _blocks(q.reshape(-1).float(), block_size) * scales.float()[:, None]
    return values.reshape(-1)[:q.numel()].to(dtype)
