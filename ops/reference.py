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

from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional

import torch

_MASK32 = 0xFFFFFFFF
# Salts that decorrelate the two state tensors' rounding noise; must match cpu_adam.cpp.
SALT_EXP_AVG = 0x3C6EF372
SALT_EXP_AVG_SQ = 0xA54FF53A


@dataclass(frozen=True)
class AdamHyper:
    """The scalars of one Adam/AdamW step: the keyword arguments that :func:`adam_step_reference`,
    :func:`fallback_adam_step`, :func:`zerotrain.ops.fused_adam_step` and
    :func:`zerotrain.ops.cuda_adam.multi_tensor_adam_step` all take (as ``**hyper``), declared
    once here. ``step`` is the step being taken, counted from 1; ``adamw``: decoupled weight decay
    (AdamW) rather than L2 added to the gradient (Adam); ``grad_scale`` multiplies the gradient
    first. The field order is the compiled ops' argument order (:meth:`native_args`)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    bias_correction: bool = True
    grad_scale: float = 1.0

    @classmethod
    def of(cls, caller: str, hyper: dict[str, Any]) -> "AdamHyper":
        """The hyperparameters among a call's keyword arguments; a missing or unknown one is a
        TypeError naming the call, as it was when each function listed them itself."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(hyper) - set(names))
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in hyper]
        if unknown or missing:
            raise TypeError(f"{caller}: unknown keyword arguments {unknown}, missing "
                            f"hyperparameters {missing}; valid hyperparameters: {', '.join(names)}")
        return cls(**hyper)

    def native_args(self) -> tuple:
        """``step`` .. ``grad_scale`` as the compiled ops (csrc/adam) take them, in this order."""
        return (int(self.step), float(self.lr), float(self.beta1), float(self.beta2),
                float(self.eps), float(self.weight_decay), bool(self.adamw),
                bool(self.bias_correction), float(self.grad_scale))


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


def _scaled_grad(grad: torch.Tensor, h: AdamHyper) -> torch.Tensor:
    """fp32 ``grad * grad_scale``: a new tensor unless grad is fp32 and unscaled; never modified
    in place by its users."""
    g = grad.float()
    return g * h.grad_scale if h.grad_scale != 1.0 else g


@torch.no_grad()
def adam_step_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                        exp_avg_sq: torch.Tensor, *, param_out: Optional[torch.Tensor] = None,
                        stochastic_rounding: bool = False, seed: int = 0, **hyper: Any) -> None:
    """One in-place Adam (``adamw=False``: L2 decay added to the gradient) or AdamW step;
    ``hyper``: the fields of :class:`AdamHyper`."""
    h = AdamHyper.of("adam_step_reference", hyper)
    g = _scaled_grad(grad, h)
    m = exp_avg if exp_avg.dtype == torch.float32 else exp_avg.float()
    v = exp_avg_sq if exp_avg_sq.dtype == torch.float32 else exp_avg_sq.float()
    if h.weight_decay != 0:
        if h.adamw:
            master.mul_(1 - h.lr * h.weight_decay)
        else:
            g = g.add(master, alpha=h.weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**h.step if h.bias_correction else 1.0
    bias_correction2 = 1 - h.beta2**h.step if h.bias_correction else 1.0
    step_size = h.lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(h.eps)
    master.addcdiv_(m, denom, value=-step_size)
    key = stochastic_rounding_key(seed, h.step)
    _store_state(exp_avg, m, stochastic_rounding, key ^ SALT_EXP_AVG)
    _store_state(exp_avg_sq, v, stochastic_rounding, key ^ SALT_EXP_AVG_SQ)
    if param_out is not None:
        param_out.copy_(master)


@torch.no_grad()
def fallback_adam_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, *, param_out: Optional[torch.Tensor] = None,
                       stochastic_rounding: bool = False, seed: int = 0, **hyper: Any) -> None:
    """The same step without the native kernel (:func:`adam_step_reference`'s arguments):
    torch's fused Adam where it applies."""
    h = AdamHyper.of("fallback_adam_step", hyper)
    fp32_state = exp_avg.dtype == torch.float32 and exp_avg_sq.dtype == torch.float32
    if not (fp32_state and h.bias_correction and master.numel() > 0):
        adam_step_reference(master, grad, exp_avg, exp_avg_sq, param_out=param_out,
                            stochastic_rounding=stochastic_rounding, seed=seed, **hyper)
        return
    fused = torch._fused_adamw_ if h.adamw else torch._fused_adam_
    # Torch's fused kernel writes the gradient only when given its own grad_scale, which we never
    # pass, so the caller's fp32 gradient is left alone.
    fused(
        [master], [_scaled_grad(grad, h)], [exp_avg], [exp_avg_sq], [],
        [torch.tensor(float(h.step), dtype=torch.float32, device=master.device)],
        lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps,
        amsgrad=False, maximize=False,
    )
    if param_out is not None:
        param_out.copy_(master)
