"""DeepSpeed's host Adam arithmetic (``fused_adam_step(order="deepspeed")``): its fp32 bias-correction
powers and a pure-torch oracle of its element step.

DeepSpeed 0.19.8's host kernel (``ds_adam_step``, what ``DeepSpeedCPUAdam`` and the CPU build of
``FusedAdam`` run) keeps ``beta1^step`` and ``beta2^step`` as fp32 state of one C++ optimizer
object: a call whose betas equal the previous call's and whose step is one more multiplies them by
the betas in fp32; the same step leaves them; any other call recomputes them as
``float(pow(double(beta), step))``. :class:`DeepSpeedBetaPowers` is that state machine;
:func:`deepspeed_beta_powers` the powers of a run that stepped 1, 2, ..., ``step`` with fixed betas.

:func:`deepspeed_adam_reference` is the same step as csrc/adam/cpu_adam.cpp's ``order="deepspeed"``
path written with torch ops (fp32 fused multiply-adds emulated exactly in float64): the fallback
when the native kernel is unavailable, and the tests' oracle.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Optional

import torch

from .reference import SALT_EXP_AVG, SALT_EXP_AVG_SQ, AdamHyper, _store_state, stochastic_rounding_key

#: DeepSpeed's vector kernel covers ``numel`` rounded down to this; the rest is its scalar tail.
DS_VECTOR_BLOCK = 16


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a C++ float conversion does)."""
    return struct.unpack("f", struct.pack("f", x))[0]


class DeepSpeedBetaPowers:
    """``Adam_Optimizer::IncrementStep`` of DeepSpeed's host kernel: the fp32 ``beta^step`` pair one
    DeepSpeed optimizer object holds. ``betas`` are the ones it was created with (``FusedAdam``'s
    CPU kernel creates its objects with zeros, one per AdamW/Adam mode and process)."""

    def __init__(self, betas: tuple[float, float] = (0.0, 0.0)) -> None:
        self.beta1, self.beta2 = f32(betas[0]), f32(betas[1])
        self.step, self.beta1_t, self.beta2_t = 0, 1.0, 1.0

    def advance(self, step: int, beta1: float, beta2: float) -> tuple[float, float]:
        b1, b2 = f32(beta1), f32(beta2)
        if b1 != self.beta1 or b2 != self.beta2 or step not in (self.step, self.step + 1):
            self.beta1, self.beta2, self.step = b1, b2, step
            self.beta1_t, self.beta2_t = f32(math.pow(b1, step)), f32(math.pow(b2, step))
        elif step == self.step + 1:
            self.step = step
            self.beta1_t, self.beta2_t = f32(self.beta1_t * b1), f32(self.beta2_t * b2)
        return self.beta1_t, self.beta2_t


_FOLDED: dict[tuple[float, float], DeepSpeedBetaPowers] = {}


def deepspeed_beta_powers(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """The fp32 ``(beta1^step, beta2^step)`` DeepSpeed holds after steps 1, 2, ..., ``step`` with these
    betas (a running fp32 product; cached, so consecutive steps cost one multiply)."""
    key = (f32(beta1), f32(beta2))
    state = _FOLDED.get(key)
    if state is None or step < state.step:
        state = _FOLDED[key] = DeepSpeedBetaPowers(key)
    while state.step < step:
        state.advance(state.step + 1, *key)
    return state.beta1_t, state.beta2_t


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once: the product is exact in float64, the sum's rounding error
    is recovered exactly (TwoSum) and breaks the one case float64 rounding could get wrong, a sum
    that rounds onto an fp32 halfway point."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.float()
    back = r.double()
    other = torch.nextafter(r, torch.where(back < s, torch.full_like(r, math.inf), torch.full_like(r, -math.inf)))
    halfway = (back != s) & ((back + other.double()) / 2 == s) & (err != 0)
    up = torch.where(back > other.double(), r, other)
    down = torch.where(back > other.double(), other, r)
    return torch.where(halfway, torch.where(err > 0, up, down), r)


@torch.no_grad()
def deepspeed_adam_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor, *, param_out: Optional[torch.Tensor] = None,
                             beta_powers: Optional[tuple[float, float]] = None,
                             stochastic_rounding: bool = False, seed: int = 0, **hyper: Any) -> None:
    """One in-place step in DeepSpeed's operation order (csrc/adam/cpu_adam.cpp, ``order="deepspeed"``);
    ``beta_powers`` default: :func:`deepspeed_beta_powers` of the step. Each fp32 operation is done
    in float64 and rounded to fp32 (exact for +, -, *, / and sqrt: 53 >= 2 * 24 + 2 bits; torch's own
    fp32 sqrt on CPU is not correctly rounded)."""
    h = AdamHyper.of("deepspeed_adam_reference", hyper)
    b1t, b2t = beta_powers if beta_powers is not None else deepspeed_beta_powers(h.beta1, h.beta2, h.step)
    alpha, beta1, beta2, wd, eps = f32(h.lr), f32(h.beta1), f32(h.beta2), f32(h.weight_decay), f32(h.eps)
    bc1, bc2 = 1.0, 1.0
    if h.bias_correction:
        bc1, bc2 = f32(1.0 - f32(b1t)), f32(1.0 / f32(math.sqrt(f32(1.0 - f32(b2t)))))
    step_size, decay = f32(-alpha / bc1), f32(-alpha * wd)
    omb1, omb2 = f32(1.0 - beta1), f32(1.0 - beta2)

    def rnd(x: torch.Tensor) -> torch.Tensor:  # an fp32 result, held in float64
        return x.float().double()

    def fma(a: Any, b: Any, c: Any) -> torch.Tensor:
        return _fma32(torch.as_tensor(a), torch.as_tensor(b), torch.as_tensor(c)).double()

    p, g = master.double(), grad.double()
    if h.grad_scale != 1.0:
        g = rnd(g * f32(h.grad_scale))
    if wd > 0 and not h.adamw:
        g = fma(p, wd, g)
    m, v = exp_avg.double(), exp_avg_sq.double()
    n = master.numel()
    tail = torch.arange(n).view(master.shape) >= n - n % DS_VECTOR_BLOCK
    gg = rnd(g * g)
    m = torch.where(tail, fma(m, beta1, rnd(g * omb1)), fma(g, omb1, rnd(m * beta1)))
    v = torch.where(tail, fma(v, beta2, rnd(gg * omb2)), fma(gg, omb2, rnd(v * beta2)))
    update = rnd(m / fma(rnd(v.sqrt()), bc2, eps))
    if wd > 0 and h.adamw:
        p = fma(p, decay, p)
    p = fma(update, step_size, p).float()
    master.copy_(p)
    key = stochastic_rounding_key(seed, h.step)
    _store_state(exp_avg, m.float(), stochastic_rounding, key ^ SALT_EXP_AVG)
    _store_state(exp_avg_sq, v.float(), stochastic_rounding, key ^ SALT_EXP_AVG_SQ)
    if param_out is not None:
        param_out.copy_(p)
