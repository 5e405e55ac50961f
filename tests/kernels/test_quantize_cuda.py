"""The CUDA block-wise int8 quantization (csrc/quantize/quantize.cu).

Where nvcc exists the file must compile: the kernels alone (default suite), and with the torch op
registration against the installed torch headers (`-m slow`). Where a GPU exists, the op must equal
the pure-torch oracle bit for bit, as the CPU kernel does.
"""
import os

import pytest
import torch

from zerotrain.ops import builder
from zerotrain.ops.quantize_reference import dequantize_reference, quantize_reference

from native_ops import NVCC, assert_nvcc_compiles  # tests/kernels/ is on sys.path (conftest)

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(builder.__file__))),
                      "csrc", "quantize", "quantize.cu")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("with_torch", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["kernels-only", "torch-op"])
def test_compiles_with_nvcc(tmp_path, with_torch):
    assert_nvcc_compiles(SOURCE, tmp_path, with_torch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, block", [(5003, 256), (70001, 2048), (37, 256)])
def test_matches_reference_on_gpu(dtype, n, block):
    from zerotrain.ops.quantize import dequantize_blockwise, quantize_blockwise

    if builder.load_op(builder.QUANTIZE_CUDA) is None:
        pytest.fail(f"CUDA op did not build: {builder.load_error(builder.QUANTIZE_CUDA)}")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 4, (n,), generator=gen).float()
    x[3] = float("nan")
    x = x.to(dtype)
    q, s = quantize_blockwise(x.cuda(), block)
    rq, rs = quantize_reference(x, block)
    torch.testing.assert_close(q.cpu(), rq, rtol=0, atol=0)
    torch.testing.assert_close(s.cpu(), rs, rtol=0, atol=0, equal_nan=True)
    out = dequantize_blockwise(q, s, block, dtype=dtype)
    torch.testing.assert_close(out.cpu(), dequantize_reference(rq, rs, block, dtype), rtol=0, atol=0,
                               equal_nan=True)
