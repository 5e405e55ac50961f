"""The fused Adam/AdamW step written with plain torch ops.

:func:`adam_step_reference` is the test oracle: the same update as csrc/adam/cpu_adam.cpp, in the
same operation order as ``torch.optim.Adam``/``AdamW`` (single-tensor path), including bf16 state
storage (round to nearest even, or the kernel's exact stochastic rounding) and the low-precision
parameter copy. It runs on any device.

:func:`fallback_adam_step` is what :func:`zerotrain.ops.fused_adam_step` runs when the native
kernel is unavailable: torch's own fused Adam/AdamW kernel where it applies (fp32 state with bias
correction), the reference otherwise. It gives the same result to rounding, with extra passes over
memory (the fp32 copy of a bf16 gradient, the separate parameter copy).
"""
from __future__ import annotations

from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF
# Salts that decorrelate the two state tensors' rounding noise; must match cpu_adam.cpp.
SALT_EXP_AVG = 0x3C6EF372
SALT_EXP_AVG_SQ = 0xA54FF53A


def stochastic_rounding_key(seed: int, step: int) -> int:
    """The 32-bit hash key of one step: different noise every step from one seed."""
    return ((seed & _MASK32) ^ ((step * 0x9E3779B9) & _MASK32)) & _MASK32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash_u32(numel: int, key: int, device: torch.device) -> torch.Tensor:
    """Per-element uint32 hash (as int64) of the element index; simd.h's `hash_u32`."""
    x = torch.arange(numel, dtype=torch.int64, device=device) & _MASK32
    x = _mul32(x, 0x9E3779B1) ^ key
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def round_to_bf16_stochastic(x: torch.Tensor, key: int) -> torch.Tensor:
    """fp32 -> bf16 by adding 16 hashed random bits below the bf16 mantissa and truncating."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    noise = _hash_u32(x.numel(), key, x.device).view(x.shape) & 0xFFFF
    upper = ((bits + noise) >> 16) & 0xFFFF
    upper = torch.where(torch.isnan(x), torch.full_like(upper, 0x7FC0), upper)
    upper = torch.where(upper >= 0x8000, upper - 0x10000, upper)  # as signed int16
    return upper.to(torch.int16).view(torch.bfloat16)


def _store_state(dst: torch.Tensor, value: torch.Tensor, stochastic: bool, key: int) -> None:
    if dst is value:
        return
    if stochastic and dst.dtype == torch.bfloat16:
        dst.copy_(round_to_bf16_stochastic(value, key))
    else:
        dst.copy_(value)  # torch's float -> bf16 copy rounds to nearest even


@torch.no_grad()
def adam_step_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_out: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """One in-place Adam (``adamw=False``: L2 decay added to the gradient) or AdamW step."""
    g = grad.float()  # a new tensor unless grad is fp32; never modified in place below
    if grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    if weight_decay != 0:
        if adamw:
            master.mul_(1 - lr * weight_decay)
        else:
            g = g.add(master, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    master.addcdiv_(m, denom, value=-step_size)
    key = stochastic_rounding_key(seed, step)
    _store_state(exp_avg, m, stochastic_rounding, key ^ SALT_EXP_AVG)
    _store_state(exp_avg_sq, v, stochastic_rounding, key ^ SALT_EXP_AVG_SQ)
    if param_out is not None:
        param_out.copy_(master)


@torch.no_grad()
def fallback_adam_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_out: Optional[torch.Tensor] = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
) -> None:
    """The same step without the native kernel: torch's fused Adam where it applies."""
    fp32_state = exp_avg.dtype == torch.float32 and exp_avg_sq.dtype == torch.float32
    if not (fp32_state and bias_correction and master.numel() > 0):
        adam_step_reference(
            master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction,
            grad_scale=grad_scale, param_out=param_out, stochastic_rounding=stochastic_rounding,
            seed=seed,
        )
        return
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    # Torch's fused kernel writes the gradient only when given its own grad_scale, which we never
    # pass, so the caller's fp32 gradient is left alone.
    fused(
        [master], [g], [exp_avg], [exp_avg_sq], [],
        [torch.tensor(float(step), dtype=torch.float32, device=master.device)],
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False,
    )
    if param_out is not None:
        param_out.copy_(master)
