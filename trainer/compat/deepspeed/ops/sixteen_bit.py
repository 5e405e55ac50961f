"""DeepSpeed's optimizer arithmetic for bf16 without ZeRO (``zero_optimization.stage`` 0).

DeepSpeed 0.19.8 trains a bf16 config at stage 0 with a bf16 module and wraps the optimizer in
its 16-bit optimizer (``engine._do_optimizer_sanity_check`` answers ``DDP_BFLOAT16``): the fused
one (``FP16_Optimizer``) when the basic optimizer is its ``FusedAdam`` (the config's "Adam"/"AdamW"
without ``torch_adam``), else the unfused one (``FP16_UnfusedOptimizer``: a client optimizer, the
config's ``torch_adam``). zerotrain's stage 0 keeps the fp32 parameters in the module and sums the
gradients in bf16 (``DDP(reduce_dtype=)``); its forward runs on the bf16 rounding of every parameter
and buffer (:class:`Bf16Forward`: DeepSpeed's bf16 weights), so the module's fp32 parameters are
DeepSpeed's fp32 masters and the gradients its gradients. The optimizer side is reproduced here:

* at set-up both wrappers step the optimizer once with zero gradients (their
  ``initialize_optimizer_states``): Adam's step count is one ahead of the training steps, and the
  weight decay (or Adam's L2 term) of that step is applied;
* the clip: the global norm as each computes it (fused: the norm of each group's flat fp32
  gradient, squares summed in Python floats; unfused: per-gradient norms summed as fp32 tensors,
  then per group; either through an fp32 tensor and back), ``clip = (norm + 1e-6) / max``, and the
  gradients multiplied by ``1 / clip`` only when ``clip > 1``; a non-finite norm skips the step;
* fused only: one fp32 master per param group, stepped by one host-kernel call over the whole flat
  buffer (the kernel's scalar tail is the last ``numel % 16`` elements of that call, so per-tensor
  calls round other elements differently). Here each group's parameters and Adam moments are
  views into one flat buffer per group (the state keeps torch's per-parameter layout) and the
  face's ``FusedAdam``/"Adam" steps the buffer in one call (:class:`~.adam.HostKernelSteps`).

Not reproduced (kept as before, documented): fp16 (DeepSpeed's loss scaler inside the wrapper),
gradient accumulation (DeepSpeed accumulates bf16 gradients in the bf16 module, zerotrain fp32 ones),
ops on autocast's fp32 list inside the model (autocast still runs them in fp32; DeepSpeed in bf16),
models with MoE experts (their norm joins the expert groups' norms), AutoTP and ALST (the norm over
the model-parallel group)."""
from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn


def _flat_over(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat tensor whose consecutive slices ``tensors`` are, in order; None if they are not."""
    first = tensors[0]
    base, at = first.untyped_storage().data_ptr(), first.storage_offset()
    start = at
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base or t.storage_offset() != at):
            return None
        at += t.numel()
    return first.new_empty(0).set_(first.untyped_storage(), start, (at - start,))


def flat_data(params: list[torch.Tensor]) -> torch.Tensor:
    """``params``' data as one flat buffer: the buffer they are views of, or (first call, or after
    something replaced a parameter's data) a new one they are made views of, values unchanged."""
    flat = _flat_over([p.data for p in params])
    if flat is not None:
        return flat
    with torch.no_grad():
        flat = torch.cat([p.data.reshape(-1) for p in params])
        at = 0
        for p in params:
            p.data = flat[at:at + p.numel()].view_as(p)
            at += p.numel()
    return flat


def flat_state(state: dict, params: list[torch.Tensor], key: str) -> torch.Tensor:
    """``state[p][key]`` of every parameter as one flat buffer, made so if they are not (a loaded
    optimizer state replaces them by separate tensors)."""
    tensors = [state[p][key] for p in params]
    flat = _flat_over(tensors)
    if flat is not None:
        return flat
    flat = torch.cat([t.reshape(-1) for t in tensors])
    at = 0
    for p in params:
        state[p][key] = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    return flat


def trainable_groups(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Each param group's trainable parameters (what DeepSpeed's wrappers keep of a group)."""
    return [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]


def _fp32_norm_round(total: float) -> float:
    """DeepSpeed puts the summed squares in an fp32 tensor and takes the root of its item."""
    norm = torch.tensor([float(total)], dtype=torch.float32)[0].item() ** 0.5
    return -1.0 if not math.isfinite(norm) else norm


class SixteenBitSteps:
    """The wrapper's part around the user's optimizer for one engine: ``setup`` (flat buffers when
    fused; the zero-gradient step) and ``clip`` (before each step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float, fused: bool) -> None:
        """Fused: each group's parameters become views of one buffer now, before the strategy
        wraps the module (their values unchanged), and the optimizer steps each group in one call."""
        self.optimizer, self.max_norm, self.fused = optimizer, float(max_norm), fused
        self.groups = trainable_groups(optimizer)
        self.forward: Bf16Forward | None = None
        if fused:
            optimizer.flat_groups = True
            for g in self.groups:
                if g:
                    flat_data(g)

    def setup(self) -> None:
        """DeepSpeed's ``initialize_optimizer_states``: one step on zero gradients, at the
        optimizer's configured learning rate (before any scheduler)."""
        params = [p for g in self.groups for p in g]
        with torch.no_grad():
            saved = [p.grad for p in params]
            for p in params:
                p.grad = torch.zeros_like(p)
            try:
                self.optimizer.step()
            finally:
                for p, g in zip(params, saved):
                    p.grad = g

    def grad_norm(self) -> float:
        """The global gradient norm as the wrapper computes it; -1 when not finite."""
        if self.fused:
            total = 0.0
            for g in self.groups:
                if g:
                    flat = torch.cat([p.grad.reshape(-1).float() if p.grad is not None else
                                      torch.zeros(p.numel(), dtype=torch.float32, device=p.device) for p in g])
                    total += flat.float().norm(2.0).item() ** 2.0
            norms = [_fp32_norm_round(total)]
        else:
            norms = []
            for g in self.groups:
                grads = [p.grad for p in g if p.grad is not None]
                if not grads:
                    norms.append(0.0)
                    continue
                squares = torch.zeros((), dtype=torch.float32)  # DeepSpeed: 0.0 + the first fp32 square, ...
                for i, t in enumerate(grads):
                    square = t.data.float().norm(2.0) ** 2.0
                    squares = square if i == 0 else squares + square
                norms.append(_fp32_norm_round(squares.item()))
        if any(n < 0 or not math.isfinite(n) for n in norms):
            return float("inf")
        return math.sqrt(sum(n ** 2.0 for n in norms))

    def clip(self) -> bool:
        """Clip the gradients as the wrapper does; False (nothing to step) when the norm is not
        finite, as the wrapper skips that step."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return False
        scale = 1.0
        if self.max_norm > 0.0:
            clip = (norm + 1e-6) / self.max_norm
            if clip > 1:
                scale = clip
        with torch.no_grad():
            for g in self.groups:
                for p in g:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / scale)
        return True


class Bf16Forward:
    """DeepSpeed's stage-0 module is bf16: every op of its forward sees bf16 parameters and buffers.
    zerotrain's keeps fp32 parameters (they are the masters) and autocast gives the bf16 rounding
    only to the ops on its lists (linear, conv, matmul); an embedding, a LayerNorm or a parameter
    in plain arithmetic would see fp32 weights. So: the floating buffers are cast to bf16 for good
    (as DeepSpeed casts them), and each submodule's own fp32 parameters are replaced by their bf16
    rounding while its forward runs (a pre-hook swaps them in, a hook after the forward puts the
    parameters back; a recomputation under activation checkpointing runs the hooks again). The
    gradients reach the fp32 parameters through the cast, bf16 values, as DeepSpeed's bf16 ones."""

    def __init__(self, module: nn.Module) -> None:
        with torch.no_grad():
            for b in module.buffers():
                if b.is_floating_point() and b.dtype != torch.bfloat16:
                    b.data = b.data.to(torch.bfloat16)
        self.handles = []
        for m in module.modules():
            if any(p is not None and p.dtype == torch.float32 for p in m._parameters.values()):
                self.handles.append(m.register_forward_pre_hook(self._swap_in))
                self.handles.append(m.register_forward_hook(self._swap_out, always_call=True))

    @staticmethod
    def _swap_in(m: nn.Module, args: object) -> None:
        saved = {n: p for n, p in m._parameters.items() if p is not None and p.dtype == torch.float32}
        m.__dict__.setdefault("_zt_bf16_saved", []).append(saved)
        for n, p in saved.items():
            m._parameters[n] = p.to(torch.bfloat16)  # type: ignore[assignment]  (the forward's view)

    @staticmethod
    def _swap_out(m: nn.Module, args: object, out: object) -> None:
        stack = m.__dict__.get("_zt_bf16_saved")
        if stack:
            m._parameters.update(stack.pop())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def sixteen_bit_steps(cfg, optimizer: torch.optim.Optimizer, model: nn.Module) -> SixteenBitSteps | None:
    """The wrapper DeepSpeed builds for this config and optimizer, or None where zerotrain keeps its
    own step: not bf16 at stage 0, a model with MoE experts, or parameters that are not fp32."""
    from .adam import HostKernelSteps

    if not cfg.bf16_enabled or cfg.zero_stage != 0 or cfg.strategy not in ("ddp", "single"):
        return None
    if any(cfg.strategy_options.get(axis, 1) > 1 for axis in ("tensor_parallel", "sequence_parallel")):
        return None  # DeepSpeed's norm over the model-parallel group
    params: Iterable[torch.Tensor] = [p for g in trainable_groups(optimizer) for p in g]
    if any(getattr(p, "allreduce", True) is False for p in model.parameters()):
        return None
    if any(p.dtype != torch.float32 for p in params):
        return None
    fused = isinstance(optimizer, HostKernelSteps) and all(p.device.type == "cpu" for p in params)
    steps = SixteenBitSteps(optimizer, cfg.gradient_clipping, fused)
    steps.forward = Bf16Forward(model)
    return steps
