"""``fused_adam_step(order="deepspeed")`` against DeepSpeed 0.19.8's own host Adam (``ds_adam_step``:
``DeepSpeedCPUAdam``, and ``FusedAdam``'s CPU build), when deepspeed is installed: the same operands
give the same bits (exact equality is the derived bound: the same fp32 operations in the same order),
for fp32 and bf16 parameters, fp32 and bf16 moments, AdamW and Adam, over several steps, on every
SIMD path here and in the pure-torch fallback. Sizes leave DeepSpeed's scalar tail (numel % 16
elements, whose products its compiler fuses the other way) non-empty. torch's order differs."""
from __future__ import annotations

import functools

import pytest
import torch

from zerotrain import ops
from zerotrain.ops import builder
from zerotrain.ops.deepspeed_adam import DeepSpeedBetaPowers, deepspeed_beta_powers, f32

from native_ops import native_fixtures  # tests/kernels/ is on sys.path (conftest)

pytestmark = pytest.mark.timeout(600)  # DeepSpeed builds its op on first use (cached afterwards)
native, isa = native_fixtures(builder.CPU_ADAM)
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
STEPS = 5
# (parameter dtype, moment dtype)
KINDS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.fixture(scope="module")
def deepspeed_adam():
    """DeepSpeed's host Adam op. Its first use builds it (~35 s on 2 cores in a fresh HOME), so every
    test that takes this fixture is ``slow``; the default suite keeps
    ``test_every_isa_equals_the_fallback`` (the fallback is DeepSpeed's arithmetic, checked here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        pytest.importorskip("cpuinfo")
        yield pytest.importorskip("deepspeed.ops.adam")


def _operands(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g).to(dtype)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(STEPS)]
    return start, grads


def _run(opt_cls, n, dtype, state_dtype, adamw, groups_betas=None, **kw):
    """Parameters, moments after STEPS steps of an optimizer built as DeepSpeed's scripts build it."""
    start, grads = _operands(n, dtype)
    p = start.clone().requires_grad_()
    opt = opt_cls([p], adamw_mode=adamw, fp32_optimizer_states=state_dtype == torch.float32, **HYPER, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    return p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()


@functools.lru_cache(maxsize=None)
def _deepspeed(n, dtype, state_dtype, adamw):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return _run(DeepSpeedCPUAdam, n, dtype, state_dtype, adamw)


def _kernel(n, dtype, state_dtype, adamw, order="deepspeed", **kw):
    p, grads = _operands(n, dtype)
    m, v = torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)
    for step, g in enumerate(grads, 1):
        ops.fused_adam_step(p, g, m, v, step=step, lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], adamw=adamw, order=order, **kw)
    return p, m, v


def _assert_same(got, want):
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert a.dtype == b.dtype, name
        diff = (a.float() != b.float()).sum().item()
        assert diff == 0, f"{name}: {diff} of {a.numel()} elements differ from DeepSpeed's"


@pytest.mark.slow
@pytest.mark.parametrize("n", [1013, 7])  # 1013 = 63 vectors of 16 + a tail of 5; 7: tail only
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("dtype,state_dtype", KINDS, ids=["fp32", "bf16-fp32-moments", "bf16-bf16-moments"])
def test_kernel_is_bit_identical_to_deepspeeds_cpu_adam(deepspeed_adam, isa, n, adamw, dtype, state_dtype):
    want = _deepspeed(n, dtype, state_dtype, adamw)
    _assert_same(_kernel(n, dtype, state_dtype, adamw, isa=isa), want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,state_dtype", KINDS[1:], ids=["bf16-fp32-moments", "bf16-bf16-moments"])
def test_torch_order_is_not(deepspeed_adam, native, dtype, state_dtype):
    """What the face ran before (730 of 115508 moments apart after one step, bench/CONFORMANCE.md)."""
    got = _kernel(4096 + 13, dtype, state_dtype, True, order="torch")
    want = _deepspeed(4096 + 13, dtype, state_dtype, True)
    assert any(not torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,state_dtype", KINDS, ids=["fp32", "bf16-fp32-moments", "bf16-bf16-moments"])
def test_the_fallback_is_bit_identical_too(deepspeed_adam, monkeypatch, dtype, state_dtype):
    monkeypatch.setattr(builder, "cpu_adam_module", lambda: None)
    for adamw in (True, False):
        _assert_same(_kernel(1013, dtype, state_dtype, adamw), _deepspeed(1013, dtype, state_dtype, adamw))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,state_dtype", KINDS, ids=["fp32", "bf16-fp32-moments", "bf16-bf16-moments"])
def test_the_faces_deepspeedcpuadam_equals_deepspeeds(deepspeed_adam, native, dtype, state_dtype):
    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam

    for adamw in (True, False):
        got = _run(DeepSpeedCPUAdam, 1013, dtype, state_dtype, adamw)
        _assert_same(got, _deepspeed(1013, dtype, state_dtype, adamw))


@pytest.mark.slow  # builds DeepSpeed's own CPU FusedAdam op first: 40 s on 2 cores, past the default suite's budget
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_faces_fusedadam_equals_deepspeeds(deepspeed_adam, native, dtype):
    """The script-built FusedAdam (and the config's "AdamW", the same host-kernel steps under the
    face) on CPU parameters: DeepSpeed's CPU FusedAdam runs ds_adam_step, moments of the parameter's
    dtype."""
    from zerotrain.deepspeed.ops.adam import FusedAdam

    def run(cls):
        start, grads = _operands(1013, dtype)
        p = start.clone().requires_grad_()
        opt = cls([p], **HYPER)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()

    _assert_same(run(FusedAdam), run(deepspeed_adam.FusedAdam))


@pytest.mark.slow
def test_beta_powers_follow_deepspeeds_running_product(deepspeed_adam, native):
    """Two parameter groups with other betas: DeepSpeed's one C++ object recomputes beta^step with
    pow at each change, where a run with fixed betas multiplies in fp32; both as DeepSpeed does."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam as Theirs

    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam as Ours

    def run(cls):
        (a, ga), (b, gb) = _operands(1013, torch.float32, 1), _operands(515, torch.float32, 2)
        pa, pb = a.clone().requires_grad_(), b.clone().requires_grad_()
        opt = cls([{"params": [pa]}, {"params": [pb], "betas": (0.8, 0.99)}], lr=1e-2, weight_decay=0.01)
        for step in range(STEPS):
            pa.grad, pb.grad = ga[step].clone(), gb[step].clone()
            opt.step()
        return pa.detach(), pb.detach()

    assert all(torch.equal(x, y) for x, y in zip(run(Ours), run(Theirs)))
    b = DeepSpeedBetaPowers((0.9, 0.999))
    assert [b.advance(s, 0.9, 0.999) for s in (1, 2, 2, 3)][-1] == deepspeed_beta_powers(0.9, 0.999, 3)
    assert b.advance(7, 0.9, 0.999)[0] == f32(f32(0.9) ** 7)  # a jump: pow, as DeepSpeed


@pytest.mark.parametrize("n", [1013, 7])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("dtype,state_dtype", KINDS, ids=["fp32", "bf16-fp32-moments", "bf16-bf16-moments"])
def test_every_isa_equals_the_fallback(isa, monkeypatch, n, adamw, dtype, state_dtype):
    """Without DeepSpeed's build: each SIMD path of the kernel in DeepSpeed's order gives the
    pure-torch fallback's bits (which the slow tests above prove equal to DeepSpeed's op)."""
    got = _kernel(n, dtype, state_dtype, adamw, isa=isa)
    monkeypatch.setattr(builder, "cpu_adam_module", lambda: None)
    _assert_same(got, _kernel(n, dtype, state_dtype, adamw))


def test_order_is_checked(native):
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="order='fast'; valid: 'torch', 'deepspeed'"):
        ops.fused_adam_step(x, x.clone(), x.clone(), x.clone(), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                            eps=1e-8, weight_decay=0.0, adamw=True, order="fast")
