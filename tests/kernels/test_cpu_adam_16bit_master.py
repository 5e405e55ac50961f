"""The CPU Adam kernel on a 16-bit master (ZeRO's ``master_dtype``, offloaded: the working bf16/fp16
partition is the master, as DeepSpeedCPUAdam steps DeepSpeed's bf16 master partitions): read into
fp32, stepped there, rounded to nearest even once. So the result is exactly the fp32-master step
from the same values, rounded: equality, on every SIMD path and in the fallback."""
import pytest
import torch

from zerotrain import ops
from zerotrain.ops import builder

from native_ops import native_fixtures  # tests/kernels/ is on sys.path (conftest)

native, isa = native_fixtures(builder.CPU_ADAM)
HYPER = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)


def _tensors(master_dtype, state_dtype, n=1003):  # odd: a tail shorter than a vector
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g).to(master_dtype)
    grad = torch.randn(n, generator=g).to(master_dtype)
    m = (torch.randn(n, generator=g) * 0.1).to(state_dtype)
    v = (torch.rand(n, generator=g) * 0.01).to(state_dtype)
    return master, grad, m, v


def _check_equals_the_rounded_fp32_step(master_dtype, state_dtype, **kw):
    master, grad, m, v = _tensors(master_dtype, state_dtype)
    wide, m2, v2 = master.float(), m.clone(), v.clone()
    ops.fused_adam_step(master, grad, m, v, grad_scale=0.5, **HYPER, **kw)
    ops.fused_adam_step(wide, grad, m2, v2, grad_scale=0.5, **HYPER, **kw)
    assert master.dtype == master_dtype and torch.equal(master, wide.to(master_dtype))
    assert torch.equal(m, m2) and torch.equal(v, v2)
    assert not torch.equal(master, _tensors(master_dtype, state_dtype)[0])  # it moved


@pytest.mark.parametrize("master_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_16bit_master_is_the_fp32_step_rounded_once(isa, master_dtype, state_dtype):
    _check_equals_the_rounded_fp32_step(master_dtype, state_dtype, isa=isa)


@pytest.mark.parametrize("master_dtype", [torch.bfloat16, torch.float16])
def test_the_fallback_does_the_same(monkeypatch, master_dtype):
    monkeypatch.setattr(builder, "cpu_adam_module", lambda: None)
    _check_equals_the_rounded_fp32_step(master_dtype, torch.float32)


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_a_16bit_master_takes_its_own_gradient_type_and_no_param_out(path, monkeypatch, request):
    if path == "native":
        request.getfixturevalue("native")
    else:
        monkeypatch.setattr(builder, "cpu_adam_module", lambda: None)
    master, grad, m, v = _tensors(torch.bfloat16, torch.float32)
    with pytest.raises(TypeError, match="`master` takes a gradient of its own dtype"):
        ops.fused_adam_step(master, grad.float(), m, v, **HYPER)
    with pytest.raises(ValueError, match="is the working copy itself; `param_out` must be None"):
        ops.fused_adam_step(master, grad, m, v, param_out=torch.zeros_like(master), **HYPER)
