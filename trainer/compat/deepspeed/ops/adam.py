"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` under DeepSpeed's constructor
arguments, as the optimizers zerotrain steps: torch's fused Adam(W) and :class:`zerotrain.ops.CPUAdam`.

Both compute DeepSpeed's update (Adam, or AdamW under ``adam_w_mode``/``adamw_mode``, DeepSpeed's
default). What cannot be mirrored is refused here, when the script builds the optimizer:
``amsgrad`` (DeepSpeed refuses it too) and, for ``FusedAdam``, ``bias_correction=False`` (torch's
Adam always corrects; ``CPUAdam`` does not need to). ``DeepSpeedCPUAdam``'s
``fp32_optimizer_states`` has no effect: the parameters a zerotrain optimizer holds are always the
fp32 master weights, so its state is fp32 either way (DeepSpeed's is the parameters' dtype).
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from .....ops import CPUAdam
from ....errors import ConfigError


def _refuse_amsgrad(owner: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ConfigError(f"{owner}: amsgrad=True; valid: False (DeepSpeed's Adam kernels have no AMSGrad variant)")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` (its CUDA multi-tensor Adam): ``torch.optim.Adam`` with
    ``fused=True`` (one kernel over all parameters, on CUDA and CPU) and decoupled weight decay
    unless ``adam_w_mode=False``. ``set_grad_none`` is torch's ``zero_grad(set_to_none=True)``,
    the default."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _refuse_amsgrad("FusedAdam", amsgrad)
        if "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters:
            raise ConfigError(f"FusedAdam: torch {torch.__version__}'s Adam has no decoupled_weight_decay; valid: "
                              "torch >= 2.6, or torch.optim.AdamW / Adam")
        if not bias_correction:
            raise ConfigError("FusedAdam: bias_correction=False; valid: True (torch's fused Adam always corrects; "
                              "DeepSpeedCPUAdam takes bias_correction=False)")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode), fused=True)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: :class:`zerotrain.ops.CPUAdam` (zerotrain's compiled
    one-pass Adam for fp32 CPU parameters), AdamW unless ``adamw_mode=False``, with or without
    bias correction. For parameters on the CPU: under ZeRO offload (``offload_optimizer``) or a CPU run."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _refuse_amsgrad("DeepSpeedCPUAdam", amsgrad)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         adamw_mode=bool(adamw_mode), bias_correction=bool(bias_correction))
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
