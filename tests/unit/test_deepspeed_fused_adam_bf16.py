"""The DeepSpeed face's config "Adam"/"AdamW" (DeepSpeed builds its FusedAdam there, whose CPU
build runs DeepSpeedCPUAdam's host kernel: fp32 arithmetic on a bf16 parameter and bf16 moments,
one rounding each) steps bf16 CPU parameters with zerotrain's fused host kernel in DeepSpeed's
operation order (tests/kernels/test_cpu_adam_deepspeed_order.py compares it with DeepSpeed's), fp32
CPU parameters too (DeepSpeed's CPU FusedAdam runs the same kernel on them); `torch_adam` keeps
torch's AdamW/Adam. Exact equality is the derived bound: the same function on the
same operands (zerotrain.ops.fused_adam_step; torch's own step)."""
from __future__ import annotations

import pytest
import torch

from zerotrain.deepspeed.ops.adam import FusedAdam
from zerotrain.ops import fused_adam_step
from zerotrain.trainer.compat.deepspeed.config import _Reader, optimizer_spec

pytestmark = pytest.mark.timeout(60)
HYPER = dict(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)


def _build(section, params):
    return optimizer_spec(section, _Reader({"optimizer": section})).build(params)


def _steps(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


def _grads(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(257, generator=g).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("name,adamw", [("AdamW", True), ("Adam", True), ("Adam", False)])
def test_config_adam_steps_bf16_parameters_with_the_host_kernel(name, adamw):
    start = torch.randn(257, generator=torch.Generator().manual_seed(0)).bfloat16()
    p = start.clone().requires_grad_()
    section = {"type": name, "params": {**HYPER, "adam_w_mode": adamw}}
    got = _steps(_build(section, [p]), p, _grads(torch.bfloat16))
    want, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, g in enumerate(_grads(torch.bfloat16), 1):
        fused_adam_step(want, g, m, v, step=step, lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=HYPER["eps"],
                        weight_decay=HYPER["weight_decay"], adamw=adamw, order="deepspeed")
    assert torch.equal(got, want)
    q = start.clone().requires_grad_()  # torch's step in bf16 parts from it (what the face stepped before)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    assert not torch.equal(_steps(cls([q], **HYPER), q, _grads(torch.bfloat16)), want)


def test_fp32_parameters_take_the_host_kernel_and_torch_adam_keeps_torchs_step():
    start = torch.randn(257, generator=torch.Generator().manual_seed(0))
    p = start.clone().requires_grad_()
    got = _steps(_build({"type": "AdamW", "params": dict(HYPER)}, [p]), p, _grads(torch.float32))
    want, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for step, g in enumerate(_grads(torch.float32), 1):
        fused_adam_step(want, g, m, v, step=step, lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=HYPER["eps"],
                        weight_decay=HYPER["weight_decay"], adamw=True, order="deepspeed")
    assert torch.equal(got, want)
    ref = start.clone().requires_grad_()  # torch's fp32 AdamW: the same update to rounding, not these bits
    torch.testing.assert_close(got, _steps(torch.optim.AdamW([ref], **HYPER), ref, _grads(torch.float32)))
    b = start.bfloat16().requires_grad_()
    ref16 = start.bfloat16().requires_grad_()
    torch_adam = _build({"type": "AdamW", "params": {**HYPER, "torch_adam": True}}, [b])
    assert type(torch_adam) is torch.optim.AdamW
    assert torch.equal(_steps(torch_adam, b, _grads(torch.bfloat16)),
                       _steps(torch.optim.AdamW([ref16], **HYPER), ref16, _grads(torch.bfloat16)))


def test_scripts_fusedadam_steps_bf16_parameters_with_the_host_kernel():
    start = torch.randn(257, generator=torch.Generator().manual_seed(0)).bfloat16()
    p, q = start.clone().requires_grad_(), start.clone().requires_grad_()
    got = _steps(FusedAdam([p], **HYPER), p, _grads(torch.bfloat16))
    assert torch.equal(got, _steps(_build({"type": "AdamW", "params": dict(HYPER)}, [q]), q, _grads(torch.bfloat16)))
