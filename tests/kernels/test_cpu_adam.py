"""The native CPU Adam kernel against torch.optim and the pure-torch reference.

Every SIMD path the CPU has is tested by forcing it (the `isa` argument in-process, and
$ZEROTRAIN_ADAM_ISA in a subprocess); paths the CPU lacks are skipped with the reason. Sizes are
odd on purpose (tails shorter than a vector). The first test to need the kernel builds it into the
cache (about a minute); later runs load it.
"""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zerotrain import ops
from zerotrain.ops import builder
from zerotrain.ops.reference import (adam_step_reference, fallback_adam_step, round_to_bf16_stochastic,
                                      stochastic_rounding_key)

from native_ops import ISAS, native_fixtures  # tests/kernels/ is on sys.path (conftest)
from tolerance import assert_no_worse_than_peer, nudge_one_ulp, rel_err

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


native, isa = native_fixtures(builder.CPU_ADAM)


@pytest.fixture
def failed_build(monkeypatch):
    """Simulates a machine where compiling fails; restores the loaded kernel afterwards."""
    saved = dict(builder._CACHE)
    builder.reset_cache()

    def fail(spec):
        raise RuntimeError("simulated compiler failure: c++: not found")

    monkeypatch.setattr(builder, "_compile", fail)
    monkeypatch.delenv(builder.BUILD_POLICY_ENV, raising=False)
    yield
    builder._CACHE.clear()
    builder._CACHE.update(saved)


def new_state(n, state_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    return master, torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)


def grads(n, steps, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 0.1).to(dtype) for _ in range(steps)]


def reference(state, gs, nudge_seed=None, **kw):
    """adam_step_reference over the gradients ``gs`` from copies of ``state`` (master, m, v).
    ``nudge_seed``: the peer, every fp32 tensor moved one ulp up or down after each step
    (tolerance.nudge_one_ulp): a step as valid as the reference's own, which rounds each element."""
    master, m, v = (t.clone() for t in state)
    gen = torch.Generator().manual_seed(nudge_seed or 0)
    for step, g in enumerate(gs, start=1):
        adam_step_reference(master, g, m, v, step=step, **kw)
        if nudge_seed is not None:
            nudge_one_ulp([t for t in (master, m, v) if t.dtype == torch.float32], gen)
    return master, m, v


# ------------------------------------------------------------------------------------------------
# Against torch.optim
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "adamw, beta1, beta2, weight_decay",
    [(True, 0.9, 0.999, 0.01), (False, 0.9, 0.999, 0.01), (True, 0.3, 0.9, 0.0)],
    ids=["adamw", "adam-l2", "lerp-upper-branch"],
)
def test_matches_torch_over_100_steps(isa, adamw, beta1, beta2, weight_decay):
    n = 4099
    master, m, v = new_state(n)
    param = torch.nn.Parameter(master.clone())
    peer = torch.nn.Parameter(master.clone())  # torch's other arithmetic of the same steps
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kw = dict(lr=1e-3, betas=(beta1, beta2), eps=1e-8, weight_decay=weight_decay)
    opt, peer_opt = torch_cls([param], foreach=False, **kw), torch_cls([peer], foreach=True, **kw)
    for step, g in enumerate(grads(n, 100), start=1):
        param.grad, peer.grad = g.clone(), g.clone()
        opt.step()
        peer_opt.step()
        ops.fused_adam_step(master, g, m, v, step=step, lr=1e-3, beta1=beta1, beta2=beta2,
                            eps=1e-8, weight_decay=weight_decay, adamw=adamw, isa=isa)
    st, peer_st = opt.state[param], peer_opt.state[peer]
    # tolerance: no worse than torch's own two Adam implementations differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({"master": master, "m": m, "v": v},
                              {"master": param.detach(), "m": st["exp_avg"], "v": st["exp_avg_sq"]},
                              {"master": peer.detach(), "m": peer_st["exp_avg"], "v": peer_st["exp_avg_sq"]})


def test_matches_torch_fused_adamw(native):
    n = 1031
    master, m, v = new_state(n)
    param, peer = torch.nn.Parameter(master.clone()), torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)
    peer_opt = torch.optim.AdamW([peer], lr=1e-3, weight_decay=0.01, foreach=False)
    for step, g in enumerate(grads(n, 100), start=1):
        param.grad, peer.grad = g.clone(), g.clone()
        opt.step()
        peer_opt.step()
        ops.fused_adam_step(master, g, m, v, step=step, adamw=True, **HYPER)
    # tolerance: no worse than torch's own two AdamW implementations (fused, for-loop) differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(master, param.detach(), peer.detach())


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_reference(isa, bias_correction):
    n = 517
    master, m, v = new_state(n)
    kw = dict(adamw=True, bias_correction=bias_correction, **HYPER)
    want, peer = reference((master, m, v), grads(n, 20), **kw), reference((master, m, v), grads(n, 20), 0, **kw)
    for step, g in enumerate(grads(n, 20), start=1):
        ops.fused_adam_step(master, g, m, v, isa=isa, step=step, **kw)
    # tolerance: no worse than the reference with each step's results one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({"master": master, "m": m, "v": v}, dict(zip("master m v".split(), want)),
                              dict(zip("master m v".split(), peer)))


# ------------------------------------------------------------------------------------------------
# Low-precision inputs and outputs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_param_out_is_exactly_the_rounded_master(isa, out_dtype):
    n = 1000 + 37
    gen = torch.Generator().manual_seed(3)
    # Magnitudes from 1e-9 to 1e6: fp16 subnormals, overflow to inf, every bf16 exponent.
    master = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-9, 7, (n,), generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    g = torch.randn(n, generator=gen)
    g[5] = float("nan")  # a NaN master must come out as NaN
    for step in range(1, 4):
        ops.fused_adam_step(master, g, m, v, step=step, adamw=True, param_out=out, isa=isa,
                            **HYPER)
        torch.testing.assert_close(out, master.to(out_dtype), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out[5])


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_equal_the_upcast(isa, grad_dtype):
    n = 2053
    master, m, v = new_state(n)
    master2, m2, v2 = master.clone(), m.clone(), v.clone()
    upcast = [g.float() for g in grads(n, 10, dtype=grad_dtype)]
    want, peer = reference((master, m, v), upcast, adamw=True, **HYPER), reference((master, m, v), upcast, 0, adamw=True, **HYPER)
    for step, g in enumerate(grads(n, 10, dtype=grad_dtype), start=1):
        kw = dict(step=step, adamw=True, **HYPER)
        ops.fused_adam_step(master, g, m, v, isa=isa, **kw)
        ops.fused_adam_step(master2, g.float(), m2, v2, isa=isa, **kw)
    assert torch.equal(master, master2) and torch.equal(m, m2) and torch.equal(v, v2)
    # tolerance: no worse than the reference with each step's results one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(master, want[0], peer[0])


def test_grad_scale_folds_loss_scale_and_clip(isa):
    n = 999
    scale = 0.37 / 1024.0  # clip coefficient / loss scale
    master, m, v = new_state(n)
    master2, m2, v2 = master.clone(), m.clone(), v.clone()
    param, peer = torch.nn.Parameter(master.clone()), torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, foreach=False)
    peer_opt = torch.optim.AdamW([peer], lr=1e-3, weight_decay=0.01, foreach=True)
    for step, g in enumerate(grads(n, 30), start=1):
        scaled = g * 1024.0
        ops.fused_adam_step(master, scaled, m, v, step=step, adamw=True, grad_scale=scale,
                            isa=isa, **HYPER)
        ops.fused_adam_step(master2, scaled * scale, m2, v2, step=step, adamw=True, isa=isa,
                            **HYPER)
        param.grad, peer.grad = scaled * scale, scaled * scale
        opt.step()
        peer_opt.step()
    assert torch.equal(master, master2)
    # tolerance: no worse than torch's own two AdamW implementations (for-loop, foreach) differ (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(master, param.detach(), peer.detach())


def test_bf16_state_round_to_nearest_even(isa):
    n = 1029
    master, m, v = new_state(n, torch.bfloat16)
    (rmaster, rm, rv), peer = reference((master, m, v), grads(n, 20), adamw=True, **HYPER), \
        reference((master, m, v), grads(n, 20), 0, adamw=True, **HYPER)
    for step, g in enumerate(grads(n, 20), start=1):
        ops.fused_adam_step(master, g, m, v, isa=isa, step=step, adamw=True, **HYPER)
    assert m.dtype == v.dtype == torch.bfloat16
    for got, want in ((m, rm), (v, rv)):
        # tolerance: a few-ulp fp32 difference may flip a bf16 rounding: one bf16 ulp, <= 2^-7 |x| (8 significant bits)
        assert bool(((got.float() - want.float()).abs() <= 2**-7 * want.float().abs()).all())
    # tolerance: no worse than the reference with each step's fp32 master one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(master, rmaster, peer[0])


@pytest.mark.parametrize("stochastic", [False, True], ids=["rne", "stochastic"])
def test_bf16_state_rounding_is_exact(isa, stochastic):
    # beta1 = beta2 = 0 makes m = g and v = g*g exactly, so only the bf16 rounding is tested.
    n = 3001
    g = torch.randn(n) * 3
    master, m, v = new_state(n, torch.bfloat16)
    rmaster, rm, rv = master.clone(), m.clone(), v.clone()
    kw = dict(step=7, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw=True,
              stochastic_rounding=stochastic, seed=1234)
    ops.fused_adam_step(master, g, m, v, isa=isa, **kw)
    adam_step_reference(rmaster, g, rm, rv, **kw)
    assert torch.equal(m.view(torch.int16), rm.view(torch.int16))
    assert torch.equal(v.view(torch.int16), rv.view(torch.int16))
    if not stochastic:
        assert torch.equal(m, g.to(torch.bfloat16))


def test_stochastic_rounding_is_unbiased(native):
    n = 200_003
    value = 1.0 + 2.0**-9 + 2.0**-11  # between two bf16 values: 1 + 2^-8 * (0.5 + 0.125)
    g = torch.full((n,), value)
    master, m, v = new_state(n, torch.bfloat16)
    ops.fused_adam_step(master, g, m, v, step=1, lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8,
                        weight_decay=0.0, adamw=True, stochastic_rounding=True, seed=5)
    assert set(m.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(m.double().mean().item() - value) < 4e-5  # 5 sigma; RNE is off by 2.4e-3


# ------------------------------------------------------------------------------------------------
# Threads, alignment, ISA selection
# ------------------------------------------------------------------------------------------------
def test_results_do_not_depend_on_threads_or_alignment(isa):
    n = 200_003
    g = grads(n, 1, dtype=torch.bfloat16)[0]
    results = []
    for threads, offset in [(1, 0), (2, 0), (2, 1)]:
        buf = torch.empty(n + offset)
        master = buf[offset:]
        master.copy_(new_state(n)[0])
        m = torch.zeros(n + offset, dtype=torch.bfloat16)[offset:]
        v = torch.zeros(n + offset, dtype=torch.bfloat16)[offset:]
        out = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
        for step in (1, 2):
            ops.fused_adam_step(master, g, m, v, step=step, adamw=True, param_out=out,
                                stochastic_rounding=True, seed=9, n_threads=threads, isa=isa,
                                **HYPER)
        results.append((master.clone(), m.clone(), v.clone(), out.clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


def test_env_var_forces_the_isa_in_a_subprocess(isa, tmp_path):
    n = 77
    script = textwrap.dedent(f"""
        import json, torch
        from zerotrain import ops
        master = torch.linspace(-1, 1, {n}); m = torch.zeros({n}); v = torch.zeros({n})
        g = torch.linspace(0.5, -0.3, {n}, dtype=torch.bfloat16)
        ops.fused_adam_step(master, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.1, adamw=True)
        print(json.dumps({{"isa": ops.kernel_info()["isa"], "master": master.tolist()}}))
    """)
    env = dict(os.environ, ZEROTRAIN_ADAM_ISA=isa, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["isa"] == isa
    master, m, v = torch.linspace(-1, 1, n), torch.zeros(n), torch.zeros(n)
    g = torch.linspace(0.5, -0.3, n, dtype=torch.bfloat16)
    ops.fused_adam_step(master, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.1, adamw=True, isa=isa)
    assert torch.equal(torch.tensor(result["master"]), master)


def test_isa_override_in_process(native, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_ADAM_ISA", "scalar")
    assert ops.kernel_info()["isa"] == "scalar"
    monkeypatch.setenv("ZEROTRAIN_ADAM_ISA", "avx9")
    with pytest.raises(ValueError, match="ZEROTRAIN_ADAM_ISA='avx9' is not a known ISA"):
        ops.kernel_info()
    missing = [i for i in ISAS if i not in native.supported_isas()]
    if missing:
        monkeypatch.setenv("ZEROTRAIN_ADAM_ISA", missing[0])
        with pytest.raises(RuntimeError, match="lacks it"):
            ops.kernel_info()
    monkeypatch.delenv("ZEROTRAIN_ADAM_ISA")
    assert ops.kernel_info()["isa"] == native.supported_isas()[0]


# ------------------------------------------------------------------------------------------------
# Input checks (the native kernel and the fallback say the same thing)
# ------------------------------------------------------------------------------------------------
def _bad_inputs():
    n = 33
    f32, bf16 = torch.float32, torch.bfloat16

    def base():
        return dict(master=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n),
                    exp_avg_sq=torch.zeros(n), param_out=None)

    shared = torch.zeros(2 * n)
    cases = {
        "master-dtype": (dict(master=torch.zeros(n, dtype=torch.float64)), TypeError, "`master`"),
        "grad-numel": (dict(grad=torch.zeros(n + 1)), ValueError, "`grad` has 34 elements"),
        "grad-dtype": (dict(grad=torch.zeros(n, dtype=torch.int32)), TypeError, "`grad` must be"),
        "exp_avg-noncontig": (dict(exp_avg=torch.zeros(2 * n)[::2]), ValueError,
                              "`exp_avg` must be contiguous"),
        "state-mismatch": (dict(exp_avg_sq=torch.zeros(n, dtype=bf16)), TypeError,
                           "`exp_avg` .* and `exp_avg_sq` .* same dtype"),
        "param_out-dtype": (dict(param_out=torch.zeros(n, dtype=f32)), TypeError, "`param_out`"),
        "grad-device": (dict(grad=torch.zeros(n, device="meta")), ValueError, "`grad`"),
        "aliasing": (dict(exp_avg=shared[:n], exp_avg_sq=shared[n - 1:2 * n - 1]), ValueError,
                     "`exp_avg` and `exp_avg_sq` share memory"),
    }
    for name, (override, exc, pattern) in cases.items():
        yield pytest.param({**base(), **override}, {}, exc, pattern, id=name)
    hyper_cases = {
        "step-0": (dict(step=0), "`step` must be >= 1"),
        "beta1-1": (dict(beta1=1.0), "`beta1` must be in"),
        "lr-negative": (dict(lr=-1.0), "`lr` must be >= 0"),
        "eps-negative": (dict(eps=-1e-8), "`eps` must be >= 0"),
    }
    for name, (hyper, pattern) in hyper_cases.items():
        yield pytest.param(base(), hyper, ValueError, pattern, id=name)


@pytest.mark.parametrize("tensors, hyper, exc, pattern", list(_bad_inputs()))
@pytest.mark.parametrize("path", ["native", "fallback"])
def test_input_errors_name_the_argument(path, tensors, hyper, exc, pattern, request):
    if path == "native":
        request.getfixturevalue("native")
    else:
        request.getfixturevalue("failed_build")
    kw = dict(step=1, adamw=True, **HYPER)
    kw.update(hyper)
    t = tensors
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(exc, match=pattern):
            ops.fused_adam_step(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"],
                                param_out=t["param_out"], **kw)


def test_unknown_isa_argument(native):
    n = 5
    with pytest.raises(ValueError, match="the `isa` argument='sse9' is not a known ISA"):
        ops.fused_adam_step(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n),
                            step=1, adamw=True, isa="sse9", **HYPER)


# ------------------------------------------------------------------------------------------------
# The fallback
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_failed_build_warns_once_and_still_matches(failed_build, state_dtype):
    n = 1001
    master, m, v = new_state(n, state_dtype)
    out = torch.empty(n, dtype=torch.bfloat16)
    gs = grads(n, 10, dtype=torch.bfloat16)
    want, peer = reference((master, m, v), gs, adamw=True, grad_scale=0.5, **HYPER), \
        reference((master, m, v), gs, 0, adamw=True, grad_scale=0.5, **HYPER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, g in enumerate(gs, start=1):
            ops.fused_adam_step(master, g, m, v, param_out=out, step=step, adamw=True, grad_scale=0.5, **HYPER)
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "simulated compiler failure" in str(ours[0].message)
    assert "fallback" in str(ours[0].message)
    info = ops.kernel_info()
    assert info["provider"] == "torch" and not info["native"]
    assert "simulated compiler failure" in info["error"]
    # tolerance: no worse than the reference with each step's fp32 results one ulp off (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(master, want[0], peer[0])
    assert torch.equal(out, master.to(torch.bfloat16))


def test_fallback_leaves_the_gradient_alone(failed_build):
    n = 64
    master, m, v = new_state(n)
    g = torch.randn(n)
    before = g.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fallback_adam_step(master, g, m, v, step=1, adamw=False, **HYPER)
        ops.fused_adam_step(master, g, m, v, step=2, adamw=True, **HYPER)
    assert torch.equal(g, before)


def test_build_policy_off_is_silent_and_strict_raises(failed_build, monkeypatch):
    n = 16
    monkeypatch.setenv(builder.BUILD_POLICY_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.fused_adam_step(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n),
                            step=1, adamw=True, **HYPER)
    builder.reset_cache()
    monkeypatch.setenv(builder.BUILD_POLICY_ENV, "1")
    with pytest.raises(RuntimeError, match="simulated compiler failure"):
        ops.fused_adam_step(torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n),
                            step=1, adamw=True, **HYPER)
    monkeypatch.setenv(builder.BUILD_POLICY_ENV, "maybe")
    with pytest.raises(ValueError, match="ZEROTRAIN_BUILD_OPS='maybe'"):
        builder.build_policy()


# ------------------------------------------------------------------------------------------------
# CPUAdam as an optimizer
# ------------------------------------------------------------------------------------------------
def _model_pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _train(model, opt, steps=25, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 13, generator=gen), torch.randn(16, 5, generator=gen)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _peer(cls, seed, bf16_state=False):
    """torch's ``cls`` whose every step is followed by an equally valid change: each parameter one
    ulp up or down (tolerance.nudge_one_ulp), or (``bf16_state``) m and v rounded to bf16 by
    ops.reference's stochastic rounding, keyed by ``seed``: torch's own arithmetic, not our kernel's."""

    class Peer(cls):
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            self.steps = getattr(self, "steps", 0) + 1
            params = [p for g in self.param_groups for p in g["params"]]
            if not bf16_state:
                nudge_one_ulp(params, self.gen)
                return
            for i, p in enumerate(params):
                for j, name in enumerate(("exp_avg", "exp_avg_sq")):
                    key = stochastic_rounding_key(seed, self.steps) ^ (2 * i + j)
                    self.state[p][name].copy_(round_to_bf16_stochastic(self.state[p][name], key))

    def make(params, **kw):
        opt = Peer(params, **kw)
        opt.gen = torch.Generator().manual_seed(seed)
        return opt

    return make


@pytest.mark.parametrize("adamw", [True, False])
def test_cpu_adam_optimizer_matches_torch(native, adamw):
    model, twin = _model_pair()
    peer_model, _ = _model_pair()
    ours = ops.CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    theirs = cls(twin.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    peer = _peer(cls, 0)(peer_model.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    ours_losses, their_losses, peer_losses = _train(model, ours), _train(twin, theirs), _train(peer_model, peer)
    # tolerance: no worse than torch's steps with each parameter one ulp off after each (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({"losses": torch.tensor(ours_losses), **dict(model.named_parameters())},
                              {"losses": torch.tensor(their_losses), **dict(twin.named_parameters())},
                              {"losses": torch.tensor(peer_losses), **dict(peer_model.named_parameters())})
    # The state layout is torch's: our state dict loads into torch.optim.
    theirs.load_state_dict(ours.state_dict())


def test_cpu_adam_bf16_state_and_bad_params(native):
    model, twin = _model_pair()
    losses = _train(model, ops.CPUAdam(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16,
                                       stochastic_rounding=True, seed=3))
    reference = torch.tensor(_train(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0)))
    assert losses[-1] < losses[0]
    peers = []
    for seed in range(4):
        peer_model, _ = _model_pair()
        peers.append(torch.tensor(_train(peer_model, _peer(torch.optim.AdamW, seed, bf16_state=True)(
            peer_model.parameters(), lr=1e-2, weight_decay=0.0))))
    # tolerance: no worse than the farthest of 4 torch AdamW runs whose m, v are stochastically rounded to bf16 (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer(torch.tensor(losses), reference, max(peers, key=lambda p: rel_err(p, reference)))
    bf16_param = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    bf16_param.grad = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 CPU parameters"):
        ops.CPUAdam([bf16_param]).step()
    with pytest.raises(ValueError, match="state_dtype"):
        ops.CPUAdam(model.parameters(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"betas .* got \(0.9, 1.0\)"):
        ops.CPUAdam(model.parameters(), betas=(0.9, 1.0))


# ------------------------------------------------------------------------------------------------
# Providers and configs
# ------------------------------------------------------------------------------------------------
def test_providers():
    assert "native" in ops.available_providers() and "torch" in ops.available_providers()
    try:
        import apex.optimizers  # noqa: F401
        has_apex = torch.cuda.is_available()
    except Exception:
        has_apex = False
    if not has_apex:
        assert ops.apex_fused_adam_available() is False
