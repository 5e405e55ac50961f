"""The block-wise int8 quantization kernel (csrc/quantize/quantize.cpp) against its pure-torch
oracle (zerotrain/ops/quantize_reference.py).

Every SIMD path the CPU has is forced (the `isa` argument in-process, $ZEROTRAIN_QUANTIZE_ISA in a
subprocess) and must equal the oracle bit for bit: the int8 codes, the scales and the dequantized
values. Sizes are odd on purpose (blocks that are not whole vectors, a short last block).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zerotrain.ops import builder
from zerotrain.ops.quantize import dequantize_blockwise, quantize_blockwise
from zerotrain.ops.quantize_reference import dequantize_reference, num_blocks, quantize_reference

from native_ops import ISAS, native_fixtures  # tests/kernels/ is on sys.path (conftest)
from tolerance import gamma

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


native, isa = native_fixtures(builder.QUANTIZE)


def values(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Magnitudes over many decades (per element), so blocks differ in scale and rounding ties
    and tiny values (which quantize to 0) occur."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 4, (n,), generator=g).float()
    return x.to(dtype)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------
# Kernel == oracle
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n, block", [(5003, 256), (70001, 2048), (37, 256), (1000, 7), (16, 16)])
def test_quantize_equals_the_reference_bit_for_bit(isa, dtype, n, block):
    x = values(n, dtype)
    q, scales = quantize_blockwise(x, block, isa=isa)
    rq, rscales = quantize_reference(x, block)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.numel() == num_blocks(n, block)
    assert_bit_equal(q, rq)
    assert_bit_equal(scales, rscales)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("n, block", [(5003, 256), (70001, 2048), (37, 256)])
def test_dequantize_equals_the_reference_bit_for_bit(isa, dtype, n, block):
    q, scales = quantize_reference(values(n, seed=1), block)
    out = dequantize_blockwise(q, scales, block, dtype=dtype, isa=isa)
    assert out.dtype == dtype
    assert_bit_equal(out, dequantize_reference(q, scales, block, dtype))


def test_every_isa_gives_the_same_codes_across_threads(native):
    """Blocks are spread over threads: the result must not depend on how many."""
    x = values(300_007)
    expected = quantize_reference(x, 256)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa_name in native.supported_isas():
                q, s = quantize_blockwise(x, 256, isa=isa_name)
                assert_bit_equal(q, expected[0])
                assert_bit_equal(s, expected[1])
    finally:
        torch.set_num_threads(before)


def test_environment_variable_forces_each_isa(native):
    code = textwrap.dedent("""
        import torch
        from zerotrain.ops import builder
        from zerotrain.ops.quantize import quantize_blockwise
        from zerotrain.ops.quantize_reference import quantize_reference
        m = builder.load_op(builder.QUANTIZE, strict=True)
        x = torch.randn(4099) * 3
        q, s = quantize_blockwise(x, 256)
        rq, rs = quantize_reference(x, 256)
        assert torch.equal(q, rq) and torch.equal(s, rs)
        print(m.selected_isa(""))
    """)
    for name in native.supported_isas():
        env = dict(os.environ, ZEROTRAIN_QUANTIZE_ISA=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == name


def test_an_isa_the_cpu_lacks_is_an_error(native):
    missing = [i for i in ISAS if i not in native.supported_isas()]
    with pytest.raises((ValueError, RuntimeError), match="not a known ISA"):
        quantize_blockwise(torch.ones(8), 4, isa="sse9")
    for name in missing:
        with pytest.raises(RuntimeError, match="lacks it"):
            quantize_blockwise(torch.ones(8), 4, isa=name)


# ------------------------------------------------------------------------------------------------
# The definition: error bound and edge cases (checked on the kernel; the oracle equals it)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [256, 2048])
def test_round_trip_error_is_at_most_half_a_scale_per_block(isa, block):
    n = 50_000 + 17
    x = values(n, seed=3)
    q, scales = quantize_blockwise(x, block, isa=isa)
    back = dequantize_blockwise(q, scales, block, isa=isa)
    err = (back - x).abs()
    nb = num_blocks(n, block)
    padded = torch.zeros(nb * block)
    padded[:n] = err
    worst = padded.view(nb, block).amax(1)
    # scale / 2, plus the division's and the multiply's roundings (2^-23 of absmax = 127 scales)
    bound = scales / 2 * (1 + 1e-4)
    assert bool((worst <= bound).all()), (worst / scales).max()
    assert int(q.abs().max()) == 127  # every block's absmax maps to +-127
    # each block's largest element comes back to within one rounding of itself
    absmax = torch.zeros(nb * block)
    absmax[:n] = x.abs()
    # tolerance: two fp32 roundings (absmax / 127, then * 127): gamma(2) relative
    torch.testing.assert_close(scales * 127, absmax.view(nb, block).amax(1), rtol=gamma(2), atol=0)


def test_all_zero_block_has_scale_zero_and_comes_back_exact(isa):
    x = values(1000, seed=4)
    x[256:512] = 0.0
    x[300] = -0.0
    q, scales = quantize_blockwise(x, 256, isa=isa)
    assert scales[1] == 0 and not bool(q[256:512].any())
    back = dequantize_blockwise(q, scales, 256, isa=isa)
    assert bool((back[256:512] == 0).all())
    assert_bit_equal(q, quantize_reference(x, 256)[0])


def test_last_partial_block_is_scaled_by_its_own_elements(isa):
    x = torch.full((256 * 3 + 5,), 100.0)
    x[-5:] = torch.tensor([0.5, -1.0, 0.25, 0.0, 0.125])
    q, scales = quantize_blockwise(x, 256, isa=isa)
    assert scales.numel() == 4 and scales[3] == torch.tensor(1.0) / torch.tensor(127.0)
    assert scales[0] == torch.tensor(100.0) / torch.tensor(127.0)
    assert q[-5:].tolist() == [64, -127, 32, 0, 16]


def test_non_finite_block_dequantizes_to_nan_and_leaves_others_alone(isa):
    x = values(1024, seed=5)
    x[10] = float("inf")
    x[600] = float("nan")
    x[900] = float("-inf")
    q, scales = quantize_blockwise(x, 256, isa=isa)
    rq, rs = quantize_reference(x, 256)
    assert_bit_equal(q, rq)
    assert_bit_equal(scales, rs)
    assert torch.isnan(scales[[0, 2, 3]]).all() and torch.isfinite(scales[1])
    assert not bool(q[:256].any()) and not bool(q[512:].any())
    back = dequantize_blockwise(q, scales, 256, isa=isa)
    assert torch.isnan(back[:256]).all() and torch.isnan(back[512:]).all()
    assert torch.isfinite(back[256:512]).all()


def test_empty_and_bad_arguments(native):
    q, s = quantize_blockwise(torch.empty(0), 256)
    assert q.numel() == 0 and s.numel() == 0
    assert dequantize_blockwise(q, s, 256).numel() == 0
    with pytest.raises(ValueError, match="block_size=0"):
        quantize_blockwise(torch.ones(4), 0)
    with pytest.raises(TypeError, match="x.dtype=torch.float64"):
        quantize_blockwise(torch.ones(4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="scales.numel"):
        dequantize_blockwise(torch.zeros(8, dtype=torch.int8), torch.ones(3), 4)
    with pytest.raises(ValueError, match="not contiguous"):
        quantize_blockwise(torch.ones(4, 4).t(), 4)


def test_writes_into_given_buffers(isa):
    x = values(600, seed=6)
    q = torch.empty(1000, dtype=torch.int8)
    s = torch.empty(10)
    quantize_blockwise(x, 128, q=q[100:700], scales=s[2:7], isa=isa)
    rq, rs = quantize_reference(x, 128)
    assert_bit_equal(q[100:700], rq)
    assert_bit_equal(s[2:7], rs)


def test_fallback_is_the_reference(monkeypatch):
    """Without the compiled op (ZEROTRAIN_BUILD_OPS=0) the reference runs, with the same result."""
    saved = dict(builder._CACHE)
    monkeypatch.setenv(builder.BUILD_POLICY_ENV, "0")
    builder._CACHE.pop(builder.QUANTIZE.name, None)
    try:
        x = values(3001, torch.bfloat16, seed=7)
        q, s = quantize_blockwise(x, 256)
        rq, rs = quantize_reference(x, 256)
        assert_bit_equal(q, rq)
        assert_bit_equal(s, rs)
        assert_bit_equal(dequantize_blockwise(q, s, 256, dtype=torch.bfloat16),
                         dequantize_reference(q, s, 256, torch.bfloat16))
    finally:
        builder._CACHE.clear()
        builder._CACHE.update(saved)
