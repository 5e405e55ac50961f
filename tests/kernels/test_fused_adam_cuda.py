"""The CUDA multi-tensor Adam (csrc/adam/fused_adam.cu).

Where nvcc exists, the file must compile: the kernels alone (default suite), and with the torch op
registration against the installed torch headers (`-m slow`; a CPU-only torch is enough, the file
avoids c10/cuda headers).
Where a GPU exists, the op must match the pure-torch reference.
"""
import os

import pytest
import torch

from zerotrain.ops import builder
from zerotrain.ops.reference import adam_step_reference

from native_ops import NVCC, assert_nvcc_compiles  # tests/kernels/ is on sys.path (conftest)
from tolerance import assert_no_worse_than_peer, nudge_one_ulp

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(builder.__file__))),
                      "csrc", "adam", "fused_adam.cu")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize(
    "with_torch",
    # With torch's headers nvcc takes ~1.5-2 min on 2 cores: run it with `-m slow`.
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["kernels-only", "torch-op"],
)
def test_compiles_with_nvcc(tmp_path, with_torch):
    assert_nvcc_compiles(SOURCE, tmp_path, with_torch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_matches_reference_on_gpu(grad_dtype, out_dtype):
    from zerotrain.ops.cuda_adam import cuda_adam_op, multi_tensor_adam_step

    if cuda_adam_op() is None:
        pytest.fail(f"CUDA op did not build: {builder.load_error(builder.FUSED_ADAM_CUDA)}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Odd sizes, an empty tensor, and one spanning several chunks and launches.
    sizes = [1, 33, 0, 65537, 40 * 65536 * 9 + 5] + [129] * 40
    masters = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    refs = [p.clone() for p in masters]
    ms = [torch.zeros_like(p) for p in masters]
    vs = [torch.zeros_like(p) for p in masters]
    rms, rvs = [m.clone() for m in ms], [v.clone() for v in vs]
    peers, pms, pvs = [p.clone() for p in masters], [m.clone() for m in ms], [v.clone() for v in vs]
    nudge = torch.Generator().manual_seed(0)
    outs = None if out_dtype is None else [torch.empty_like(p, dtype=out_dtype) for p in masters]
    for step in range(1, 6):
        gs = [torch.randn(n, device="cuda", generator=gen).to(grad_dtype) for n in sizes]
        kw = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  adamw=True, grad_scale=0.5)
        multi_tensor_adam_step(masters, gs, ms, vs, param_outs=outs, **kw)
        for p, g, m, v in zip(refs + peers, gs + gs, rms + pms, rvs + pvs):
            adam_step_reference(p, g.float(), m, v, **kw)
        nudge_one_ulp(peers + pms + pvs, nudge)  # the peer: each step's results one ulp off
    # tolerance: no worse than the reference with each step's results one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(dict(enumerate(masters)), dict(enumerate(refs)), dict(enumerate(peers)), "tensor ")
    for i, p in enumerate(masters):
        if outs is not None:
            assert torch.equal(outs[i], p.to(out_dtype))
