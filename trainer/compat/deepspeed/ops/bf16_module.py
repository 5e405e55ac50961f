"""bf16 at ZeRO stages 1-3 as DeepSpeed 0.19.8 runs it: the module is bf16, its forward has no autocast.

DeepSpeed's engine casts every floating parameter of the module to bf16 before its ZeRO optimizer
copies the fp32 masters (``_cast_module_mixed_precision``; buffers keep their type unless the
config's ``data_types.buffer_dtype`` says otherwise) and calls the module as it is: every op of the
forward computes in the type of its operands, so a LayerNorm, a softmax or a ``cross_entropy`` of
bf16 activations computes and returns bf16 (the loss is bf16). Under autocast (zerotrain's
"bf16-mixed") those ops are on the fp32 list and return fp32, so a loss taken inside the model's
forward differed from DeepSpeed's by a bf16 step or more.

zerotrain's ZeRO strategies already keep the working parameters in ``param_dtype`` (bf16 views of
the flat working buffers; ZeRO-3 gathers its units in bf16), with fp32 (or bf16, under
``bf16_master_weights_and_grads``) masters. So the face needs two things: a precision without
autocast (:class:`Bf16Module`; the Trainer's and the Engine's "bf16-mixed" keep theirs), and the
floating parameters the strategy does not flatten (frozen ones) cast to bf16 after set-up
(:func:`cast_remaining_params`). Inputs are not cast, as DeepSpeed casts none under bf16 (only
``fp16.auto_cast``): a script passes bf16 floating inputs itself.

Not here: ZeRO stage 0 (``sixteen_bit.py``), fp16 (still autocast), the pipeline engine."""
from __future__ import annotations

import torch
from torch import nn

from .....strategies.precision import BF16Mixed


class Bf16Module(BF16Mixed):
    """"bf16-mixed" as DeepSpeed's ZeRO engine runs it: bf16 working parameters (as the mixed
    plugin's sharded strategies keep them), no autocast around the forward."""

    autocast_dtype = None


def cast_remaining_params(module: nn.Module) -> int:
    """After the strategy's set-up: the floating parameters that are not bf16 yet (those outside
    the optimizer, which the strategy leaves as built) become bf16, as DeepSpeed casts every
    parameter. Parameters partitioned away (ZeRO-3 placeholders) are the strategy's. Returns how
    many were cast."""
    from .....strategies.zero.stage3.unit import is_placeholder

    cast = 0
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != torch.bfloat16 and not is_placeholder(p):
                p.data = p.data.to(torch.bfloat16)
                cast += 1
    return cast
