"""This rank's master slices (fp32, or the working 16-bit type: ``ZeroConfig.master_dtype``), with
the user's own optimizer object re-targeted onto them.

Re-targeting: group i's ``"params"`` becomes ``[master_i]`` (one fp32 leaf tensor holding this
rank's partition of group i) and the optimizer's (still empty) state is cleared. The object the
user built in ``configure_optimizers()`` stays the one that steps, so its per-group hyperparameters
and any LR scheduler holding it keep working, and ``optimizer.state_dict()`` holds exactly this
rank's shard of the state.

An update that is element-wise (Adam, AdamW - fused too -, SGD with momentum, RMSprop, ...) gives
the same numbers on a slice as on the whole tensor. Optimizers that look at a whole parameter
(LAMB/LARS trust ratios, Adafactor's factored moments, Shampoo) would silently compute something
else on slices and are not supported.

Padding elements have zero gradients and zero values, so element-wise updates (weight decay
included) keep them at zero.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .comm.collectives import gather_to
from .comm.inflight import InFlightQueue
from .layout import GroupLayout

#: the dtypes a master slice may have (16-bit: the working partition itself, ``ZeroConfig.master_dtype``)
MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ShardedOptimizer:
    def __init__(self, optimizer: torch.optim.Optimizer,
                 masters: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> None:
        """``masters[i]``: group i's master slice, or a list of them (ZeRO-3 gives each group
        one slice per unit); ``self.masters`` is the flat list, group after group."""
        if len(masters) != len(optimizer.param_groups):
            raise ValueError(f"{len(masters)} master slices for {len(optimizer.param_groups)} param groups")
        if optimizer.state:
            raise ValueError(
                "the optimizer already holds state (was it stepped before setup?); ZeRO re-targets "
                "it onto fp32 master slices and would drop that state: build a fresh optimizer")
        self.masters = []
        for group, master in zip(optimizer.param_groups, masters):
            slices = [master] if isinstance(master, torch.Tensor) else list(master)
            for m in slices:
                if m.dtype not in MASTER_DTYPES:
                    raise ValueError(f"master slices must be fp32, bf16 or fp16, got {m.dtype}")
            group["params"] = slices
            self.masters.extend(slices)
        optimizer.state.clear()
        self.optimizer = optimizer

    def set_grads(self, grads: Sequence[torch.Tensor]) -> None:
        """Give each master slice its gradient slice (same size and dtype) for the next ``step()``."""
        for m, g in zip(self.masters, grads):
            if g.shape != m.shape or g.dtype != m.dtype:
                raise ValueError(f"gradient slice {tuple(g.shape)} {g.dtype} does not match master "
                                 f"{tuple(m.shape)} {m.dtype}")
            m.grad = g

    def clear_grads(self) -> None:
        for m in self.masters:
            m.grad = None

    def step(self) -> None:
        self.optimizer.step()

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]

    def state_dict(self) -> dict[str, Any]:
        # clone: in fp32 a master is a view of the whole working buffer, and saving a view would
        # write the whole storage
        return {"master": [m.detach().clone() for m in self.masters],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["master"]
        if len(saved) != len(self.masters):
            raise ValueError(f"checkpoint has {len(saved)} master slices, this run has {len(self.masters)}")
        for i, (m, s) in enumerate(zip(self.masters, saved)):
            if s.shape != m.shape:
                raise ValueError(f"checkpoint master slice {i} has shape {tuple(s.shape)}, this run "
                                 f"needs {tuple(m.shape)}: was it written with another world size?")
            m.detach().copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])

    def gather_full(self, index: int, layout: GroupLayout, rank: int, queue: InFlightQueue,
                    group: object = None, dst: int = 0) -> torch.Tensor | None:
        """Collective: the complete flat master buffer (the masters' dtype) of group ``index`` on
        ``dst``, None elsewhere."""
        master = self.masters[index].detach()
        if layout.padded_numel == 0:
            return torch.zeros(0) if rank == dst else None
        full = outs = None
        if rank == dst:
            full = torch.empty(layout.padded_numel, dtype=master.dtype, device=master.device)
            outs = [full[slice(*layout.partition_range(r))] for r in range(layout.world_size)]
        queue.complete(gather_to(master.contiguous(), outs, dst, group), master, label="gather masters")
        return full
