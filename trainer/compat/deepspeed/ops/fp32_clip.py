"""DeepSpeed's clip of fp32 gradients at ZeRO stage 0 (its engine's ``clip_fp32_gradients``), in
its arithmetic, so that a clipped step equals DeepSpeed's to the last bit.

DeepSpeed takes each parameter's gradient norm, squares and sums those, takes the root, averages
that total over the data-parallel ranks (equal there: the gradients are averaged already), and
multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``. zerotrain's strategies take the
norm as ``torch.nn.utils.clip_grad_norm_`` does (the norm of the per-parameter norms), which rounds
differently in the last bit; a script that clips every step (DeepSpeedExamples' GAN under
DeepSpeed's default ``gradient_clipping`` 1.0) moved 1.9e-3 away from DeepSpeed in 8 steps.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def applies(engine: Any) -> bool:
    """DeepSpeed clips so where it calls ``clip_fp32_gradients``: fp32, stage 0, no autocast; here
    also only with one data axis (no tensor or sequence axis) and no experts, whose norms zerotrain
    joins its own way (README: MoE clipping)."""
    from ..moe.layer import expert_data_groups

    cfg, strategy = engine._cfg, engine.zerotrain_engine.strategy
    return (cfg.precision == "32" and cfg.zero_stage == 0 and cfg.torch_autocast_dtype is None
            and strategy.mesh_size("tensor") == 1 and strategy.mesh_size("sequence") == 1
            and not expert_data_groups(engine.module))


def clip(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip ``module``'s gradients in place as DeepSpeed 0.19.8 does; returns the norm used."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch.stack([g.detach().float().norm(2.0) for g in grads])
    total = norms.pow(2.0).sum().float().pow(1.0 / 2.0)
    if dist.is_initialized():
        total = total * 1.0 / float(dist.get_world_size())
        dist.all_reduce(total)
    total = total.to(grads[0].device)
    coef = torch.min(torch.tensor([1.0], device=total.device),
                     torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6))
    for g in grads:
        g.detach().mul_(coef)
    return total
