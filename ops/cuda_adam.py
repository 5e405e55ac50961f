"""Multi-tensor fused Adam/AdamW for CUDA tensors (csrc/adam/fused_adam.cu).

One call updates many tensors in a few launches: fp32 master, fp32/bf16/fp16 grads (one dtype per
call), fp32 state, optional bf16/fp16 parameter copies written in the same pass. Without the
compiled op (no toolkit, failed build) it runs :func:`zerotrain.ops.reference.adam_step_reference`
per tensor, after one warning.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import builder
from .reference import adam_step_reference


def cuda_adam_op():
    """``torch.ops.zerotrain.fused_adam_cuda``, building the library on first use; else None."""
    namespace = builder.load_op(builder.FUSED_ADAM_CUDA)
    return None if namespace is None else namespace.fused_adam_cuda


@torch.no_grad()
def multi_tensor_adam_step(
    masters: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_scale: float = 1.0,
    param_outs: Optional[Sequence[torch.Tensor]] = None,
    bias_correction: bool = True,
) -> None:
    """In-place Adam/AdamW step over lists of CUDA tensors on one device (see module docstring)."""
    if not masters:
        return
    device = masters[0].device
    op = cuda_adam_op()
    if op is None:
        outs = list(param_outs) if param_outs is not None else [None] * len(masters)
        for p, g, m, v, o in zip(masters, grads, exp_avgs, exp_avg_sqs, outs):
            adam_step_reference(
                p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, adamw=adamw, bias_correction=bias_correction,
                grad_scale=grad_scale, param_out=o,
            )
        return
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        op(
            list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(param_outs) if param_outs is not None else [],
            int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            bool(adamw), bool(bias_correction), float(grad_scale), int(stream),
        )
