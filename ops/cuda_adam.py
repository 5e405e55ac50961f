"""Multi-tensor fused Adam/AdamW for CUDA tensors (csrc/adam/fused_adam.cu).

One call updates many tensors in a few launches: fp32 master, fp32/bf16/fp16 grads (one dtype per
call), fp32 state, optional bf16/fp16 parameter copies written in the same pass. Without the
compiled op (no toolkit, failed build) it runs :func:`zerotrain.ops.reference.adam_step_reference`
per tensor, after one warning.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import builder
from .reference import AdamHyper, adam_step_reference


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
    param_outs: Optional[Sequence[torch.Tensor]] = None,
    **hyper: Any,
) -> None:
    """In-place Adam/AdamW step over lists of CUDA tensors on one device (see module docstring);
    ``hyper``: the fields of :class:`~zerotrain.ops.reference.AdamHyper`."""
    h = AdamHyper.of("multi_tensor_adam_step", hyper)
    if not masters:
        return
    device = masters[0].device
    op = cuda_adam_op()
    if op is None:
        outs = list(param_outs) if param_outs is not None else [None] * len(masters)
        for p, g, m, v, o in zip(masters, grads, exp_avgs, exp_avg_sqs, outs):
            adam_step_reference(p, g, m, v, param_out=o, **hyper)
        return
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        op(
            list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs),
            list(param_outs) if param_outs is not None else [], *h.native_args(), int(stream),
        )
