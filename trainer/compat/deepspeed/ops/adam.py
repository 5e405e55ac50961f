"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` under DeepSpeed's constructor
arguments, as the optimizers zerotrain steps: torch's fused Adam(W) and :class:`zerotrain.ops.CPUAdam`.

Both compute DeepSpeed's update (Adam, or AdamW under ``adam_w_mode``/``adamw_mode``, DeepSpeed's
default). What cannot be mirrored is refused here, when the script builds the optimizer:
``amsgrad`` (DeepSpeed refuses it too) and, for ``FusedAdam``, ``bias_correction=False`` (torch's
Adam always corrects; ``CPUAdam`` does not need to). fp32 and bf16 CPU parameters (ZeRO's masters) are stepped by DeepSpeed's host kernel, bit for bit
(:class:`HostKernelSteps`), by ``FusedAdam`` and by the config's "Adam"/"AdamW" alike, as DeepSpeed's
CPU accelerator steps them; ``DeepSpeedCPUAdam`` steps every CPU parameter so.
"""
from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from .....ops import CPUAdam, fused_adam_step
from .....ops.deepspeed_adam import DeepSpeedBetaPowers
from .sixteen_bit import flat_data, flat_state
from ....errors import ConfigError

# DeepSpeed's CPU FusedAdam keeps one host-kernel object per mode (AdamW, Adam) and process, created
# with zero betas; its fp32 beta^step pair is shared by every FusedAdam of the process.
_FUSED_ADAM_POWERS = {True: DeepSpeedBetaPowers(), False: DeepSpeedBetaPowers()}


class HostKernelSteps:
    """Mixed into a torch Adam(W): its fp32 and bf16 CPU parameters (ZeRO's fp32 or 16-bit masters,
    a module on the CPU) are stepped as DeepSpeed's ``FusedAdam`` steps them on its CPU accelerator
    (one host kernel for every dtype, ``ds_adam_step``, the one ``DeepSpeedCPUAdam`` runs): the
    parameter and moments read into fp32, the update computed there in DeepSpeed's operation order,
    each stored value rounded once, by :func:`zerotrain.ops.fused_adam_step` with
    ``order="deepspeed"`` (bit-identical to ``ds_adam_step``; its fp32 ``beta^step`` kept per mode
    and process as DeepSpeed's CPU FusedAdam keeps it). torch's Adam(W) would differ in the last
    fp32 bit, and on bf16 would do every operation in bf16. Every other parameter (fp16, CUDA,
    non-contiguous; amsgrad/maximize groups) is torch's step, unchanged. The state layout
    (``step``, ``exp_avg``, ``exp_avg_sq`` of the parameter's dtype) is torch's.
    ``kernel_order`` tells ZeRO-Offload's stepper to step the masters in DeepSpeed's order too."""

    _kernel_adamw = True
    kernel_order = "deepspeed"
    #: slot (parameter position, group after group) -> ``fused_adam_step``'s ``tail``, set by the stage-3
    #: engine (``stage3_tail.py``: the elements DeepSpeed's own layout puts in its kernel's scalar tail);
    #: None: each call's own
    kernel_tail: "dict[int, list[tuple[int, int]]] | None" = None
    #: DeepSpeed's stage-0 bf16 wrapper (``sixteen_bit.py``): each group stepped as one flat buffer
    flat_groups = False

    def _kernel_param(self, p: torch.Tensor, group: dict) -> bool:
        return (p.grad is not None and p.dtype in (torch.float32, torch.bfloat16) and p.device.type == "cpu"
                and (p.grad.dtype == p.dtype or p.dtype == torch.float32)
                and p.is_contiguous() and not p.grad.is_sparse and not group.get("amsgrad")
                and not group.get("maximize") and not group.get("differentiable"))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            slot = -1
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                if self.flat_groups:
                    self._flat_step(group)
                    for p in group["params"]:  # torch's step below skips them
                        if p.grad is not None:
                            hidden.append((p, p.grad))
                            p.grad = None
                    continue
                for p in group["params"]:
                    slot += 1
                    if not self._kernel_param(p, group):
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0, dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["step"] += 1
                    step = int(state["step"].item())
                    adamw = self._kernel_adamw or bool(group.get("decoupled_weight_decay"))
                    fused_adam_step(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"],
                                    step=step, lr=float(group["lr"]), beta1=float(beta1),
                                    beta2=float(beta2), eps=group["eps"], weight_decay=group["weight_decay"],
                                    adamw=adamw, order="deepspeed",
                                    beta_powers=_FUSED_ADAM_POWERS[adamw].advance(step, beta1, beta2),
                                    tail=None if self.kernel_tail is None else self.kernel_tail.get(slot, []))
                    hidden.append((p, p.grad))
                    p.grad = None  # torch's step below skips it
            super().step()  # type: ignore[misc]
        finally:
            for p, g in hidden:
                p.grad = g
        return loss

    def _flat_step(self, group: dict) -> None:
        """DeepSpeed's ``FP16_Optimizer`` steps one flat fp32 master per group: the group's trainable
        parameters (views of one buffer, ``sixteen_bit.flat_data``) and their moments stepped by one
        kernel call, a parameter without a gradient with zeros."""
        params = [p for p in group["params"] if p.requires_grad]
        if not params:
            return
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.tensor(0.0, dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))
        grad = torch.cat([p.grad.reshape(-1).float() if p.grad is not None else
                          torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in params])
        step = int(self.state[params[0]]["step"].item()) + 1
        for p in params:
            self.state[p]["step"].fill_(step)
        beta1, beta2 = group["betas"]
        adamw = self._kernel_adamw or bool(group.get("decoupled_weight_decay"))
        fused_adam_step(flat_data(params), grad, flat_state(self.state, params, "exp_avg"),
                        flat_state(self.state, params, "exp_avg_sq"), step=step, lr=float(group["lr"]),
                        beta1=float(beta1), beta2=float(beta2), eps=group["eps"], weight_decay=group["weight_decay"],
                        adamw=adamw, order="deepspeed",
                        beta_powers=_FUSED_ADAM_POWERS[adamw].advance(step, beta1, beta2))


class DeepSpeedAdamW(HostKernelSteps, torch.optim.AdamW):
    """The config's "Adam"/"AdamW" (DeepSpeed builds its ``FusedAdam`` there, AdamW mode):
    ``torch.optim.AdamW``, fp32 and bf16 CPU parameters by DeepSpeed's host kernel."""


class DeepSpeedAdam(HostKernelSteps, torch.optim.Adam):
    """The config's "Adam" with ``adam_w_mode: false``: ``torch.optim.Adam`` (L2 weight decay),
    fp32 and bf16 CPU parameters by DeepSpeed's host kernel."""

    _kernel_adamw = False


def _refuse_amsgrad(owner: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ConfigError(f"{owner}: amsgrad=True; valid: False (DeepSpeed's Adam kernels have no AMSGrad variant)")


class FusedAdam(HostKernelSteps, torch.optim.Adam):
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
        self._kernel_adamw = self.adam_w_mode
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam``: :class:`zerotrain.ops.CPUAdam` with ``order="deepspeed"``
    (DeepSpeed's host kernel bit for bit, fp32, bf16 or fp16 CPU parameters), AdamW unless
    ``adamw_mode=False``, with or without bias correction; moments fp32, or of the parameter's
    dtype with ``fp32_optimizer_states=False`` (bf16 only: the kernel has no fp16 moments). For
    parameters on the CPU: under ZeRO offload (``offload_optimizer``) or a CPU run."""

    kernel_order = "deepspeed"

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _refuse_amsgrad("DeepSpeedCPUAdam", amsgrad)
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         adamw_mode=bool(adamw_mode), bias_correction=bool(bias_correction), order="deepspeed")
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states
        if not fp32_optimizer_states:
            half = next((p for g in self.param_groups for p in g["params"] if p.dtype == torch.float16), None)
            if half is not None:
                raise ConfigError("DeepSpeedCPUAdam: fp32_optimizer_states=False with float16 parameters; valid: "
                                  "True, or bfloat16 parameters (the host kernel keeps no float16 moments)")

    def _state_for(self, p: torch.Tensor) -> dict:
        keep = self.fp32_optimizer_states or p.dtype == torch.float32
        self.state_dtype = torch.float32 if keep else p.dtype
        return super()._state_for(p)


__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]
