"""Block-wise int8 quantization for ZeRO++'s quantized communication (qwZ, qgZ).

:func:`quantize_blockwise` turns a flat fp32/bf16/fp16 tensor into int8 codes and one fp32 scale
per block of ``block_size`` elements; :func:`dequantize_blockwise` turns them back. The definition
(rounding, all-zero and non-finite blocks) is :mod:`zerotrain.ops.quantize_reference`'s; CPU
tensors run the SIMD kernel (csrc/quantize/quantize.cpp: AVX-512, AVX2 or scalar, forced with
``isa=`` or ``$ZEROTRAIN_QUANTIZE_ISA``), CUDA tensors the CUDA kernel (csrc/quantize/quantize.cu).
Both are built on first use; without them (no toolchain, ``ZEROTRAIN_BUILD_OPS=0``) the reference
runs, after one warning, with bit-identical results.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import builder
from .quantize_reference import dequantize_reference, num_blocks, quantize_reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_SIZE = 256

__all__ = ["quantize_blockwise", "dequantize_blockwise", "num_blocks", "DEFAULT_BLOCK_SIZE"]


def _cuda_ops() -> Any:
    """``torch.ops.zerotrain`` with the CUDA quantize ops registered, else None."""
    return builder.load_op(builder.QUANTIZE_CUDA)


def _check_block(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"quantize: block_size={block_size!r}: not a positive integer; valid: >= 1")
    return block_size


def _check(t: torch.Tensor, name: str, numel: int, dtypes: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"quantize: {name}={type(t).__name__}: not a tensor; valid: a tensor")
    if t.dtype not in dtypes:
        raise TypeError(f"quantize: {name}.dtype={t.dtype}: unsupported; valid: "
                        f"{', '.join(str(d) for d in dtypes)}")
    if t.device != device:
        raise ValueError(f"quantize: {name}.device={t.device}: differs from the data's; valid: {device}")
    if not t.is_contiguous():
        raise ValueError(f"quantize: {name}: not contiguous; valid: a contiguous (flat) tensor")
    if t.numel() != numel:
        raise ValueError(f"quantize: {name}.numel()={t.numel()}: does not match the data; valid: {numel}")


@torch.no_grad()
def quantize_blockwise(x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *,
                       q: Optional[torch.Tensor] = None, scales: Optional[torch.Tensor] = None,
                       isa: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (contiguous, fp32/bf16/fp16) -> ``(q, scales)``: int8 codes (``x.numel()``, flat) and
    fp32 scales (one per block). Pass ``q``/``scales`` to write into existing buffers (e.g. slices
    of a collective's input). ``isa`` forces a CPU path ("avx512", "avx2", "scalar")."""
    _check_block(block_size)
    _check(x, "x", x.numel(), FLOAT_DTYPES, x.device)
    n, nb = x.numel(), num_blocks(x.numel(), block_size)
    q = torch.empty(n, dtype=torch.int8, device=x.device) if q is None else q
    scales = torch.empty(nb, dtype=torch.float32, device=x.device) if scales is None else scales
    _check(q, "q", n, (torch.int8,), x.device)
    _check(scales, "scales", nb, (torch.float32,), x.device)
    native = _native(x)
    if native is None:
        ref_q, ref_scales = quantize_reference(x, block_size)
        q.copy_(ref_q)
        scales.copy_(ref_scales)
    elif x.is_cuda:
        native.quantize_blockwise_cuda(x, q, scales, block_size, torch.cuda.current_stream(x.device).cuda_stream)
    else:
        native.quantize(x, q, scales, block_size, isa or "")
    return q, scales


@torch.no_grad()
def dequantize_blockwise(q: torch.Tensor, scales: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, *,
                         out: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32,
                         isa: Optional[str] = None) -> torch.Tensor:
    """int8 codes ``q`` and their ``scales`` -> ``out`` (flat, fp32/bf16/fp16; allocated in
    ``dtype`` when not given)."""
    _check_block(block_size)
    _check(q, "q", q.numel(), (torch.int8,), q.device)
    _check(scales, "scales", num_blocks(q.numel(), block_size), (torch.float32,), q.device)
    out = torch.empty(q.numel(), dtype=dtype, device=q.device) if out is None else out
    _check(out, "out", q.numel(), FLOAT_DTYPES, q.device)
    native = _native(q)
    if native is None:
        out.copy_(dequantize_reference(q, scales, block_size, out.dtype).view(out.shape))
    elif q.is_cuda:
        native.dequantize_blockwise_cuda(q, scales, out, block_size,
                                         torch.cuda.current_stream(q.device).cuda_stream)
    else:
        native.dequantize(q, scales, out, block_size, isa or "")
    return out


def _native(t: torch.Tensor) -> Any:
    """The compiled op for ``t``'s device, or None (the reference runs)."""
    if t.is_cuda:
        return _cuda_ops()
    if t.device.type != "cpu":
        return None
    return builder.quantize_module()
