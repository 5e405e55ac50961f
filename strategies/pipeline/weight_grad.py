"""A backward in two parts, for zero-bubble schedules: linear layers' weight gradients later.

While ``DeferWeightGrads(stash)`` is active (a ``TorchFunctionMode`` the stage enters around a
micro-batch's forward), every ``F.linear`` whose weight is a leaf tensor that needs a gradient runs
as ``_DeferredLinear``. Its backward returns the gradients of the input and the bias at once and
appends ``(weight, grad_output, input)`` to ``stash`` instead of the weight's gradient;
``apply_weight_grads(stash)`` computes those later, ``grad_output^T @ input`` flattened over the
leading dimensions, and accumulates each into ``weight.grad`` (set when it is None, added in the
product otherwise: equal to autograd's to rounding), in the order backward reached them. Every
other parameter (embeddings, norms, biases) gets its gradient in the backward as usual. For a transformer the linear layers'
weight gradients are about half of the backward's work.

Under autocast the input, weight and bias are cast the way autocast casts ``linear`` and the
product runs with autocast off, so the forward and both gradients are computed in the dtype they
would be without deferral; a weight gradient computed in a lower precision is cast to the
weight's dtype when accumulated, as autocast's cast-back does.

A recomputed forward (activation checkpointing) runs outside the mode, so checkpointing cannot be
combined with deferral: the pipeline's config refuses it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Stash = list  # of (weight, grad_output, input)

_LINEAR = (F.linear, torch._C._nn.linear)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward stashes the weight's gradient inputs. With ``dtype`` (autocast's)
    the product and the stash use the weight cast to it; the leaf receives the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype | None, stash: Stash) -> torch.Tensor:
        used = weight if dtype is None else weight.to(dtype)
        ctx.save_for_backward(x, used)
        ctx.has_bias, ctx.stash, ctx.weight_leaf = bias is not None, stash, weight
        return F.linear(x, used, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, used = ctx.saved_tensors
        grad_x = grad_out.matmul(used) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        ctx.stash.append((ctx.weight_leaf, grad_out, x))
        return grad_x, None, grad_b, None, None


class DeferWeightGrads(TorchFunctionMode):
    """Route leaf-weight ``F.linear`` calls through ``_DeferredLinear``, stashing into ``stash``."""

    def __init__(self, stash: Stash) -> None:
        super().__init__()
        self.stash = stash

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LINEAR:
            x, weight, bias = _linear_args(args, kwargs)
            if (torch.is_grad_enabled() and isinstance(weight, torch.Tensor) and weight.requires_grad
                    and weight.grad_fn is None):
                return _deferred(x, weight, bias, self.stash)
        return func(*args, **kwargs)


def _linear_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "weight", "bias")
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    return values[0], values[1], values[2]


def _deferred(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stash: Stash) -> torch.Tensor:
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return _DeferredLinear.apply(x, weight, bias, None, stash)
    dtype = torch.get_autocast_dtype(kind)
    with torch.autocast(kind, enabled=False):
        # input and bias cast outside the Function, so autograd carries their gradients back
        # through the casts; the weight's is cast back in apply_weight_grads
        return _DeferredLinear.apply(x.to(dtype), weight, None if bias is None else bias.to(dtype), dtype, stash)


def apply_weight_grads(stash: Stash) -> None:
    """Compute and accumulate every stashed weight gradient, then empty ``stash``. A gradient
    that already exists takes the product in place (``addmm_``: no temporary the size of the
    weight, no separate pass to add it), which is why a pipeline stage running many micro-batches
    spends less here than autograd's accumulation."""
    with torch.no_grad():
        for weight, grad_out, x in stash:
            g, inp = grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1])
            if weight.grad is None:
                weight.grad = g.mm(inp).to(weight.dtype)
            elif g.dtype == weight.grad.dtype:
                weight.grad.addmm_(g, inp)
            else:  # a lower-precision product, cast back as autocast would
                weight.grad.add_(g.mm(inp).to(weight.grad.dtype))
    stash.clear()
