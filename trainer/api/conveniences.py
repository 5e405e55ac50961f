"""What ``self.print`` and ``self.all_gather`` of a TrainModule do, as Lightning's."""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from ...strategies import progress


def rank_zero_print(trainer: Any, *args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (any process when no Trainer is attached); through the
    progress bar's ``tqdm.write`` while one is drawn, so the bar is not torn."""
    if trainer is not None and not trainer.is_global_zero:
        return
    from ...callbacks.progress import ProgressBar

    bar = next((cb for cb in (trainer.callbacks if trainer is not None else [])
                if isinstance(cb, ProgressBar) and getattr(cb, "is_enabled", False)), None)
    if bar is None:
        print(*args, **kwargs)
        return
    bar.print(*args, **kwargs)  # file= too (tqdm.write writes there), as Lightning


def _to_tensors(data: Any, device: torch.device) -> Any:
    """Numbers and numpy arrays as tensors, everything on ``device`` (Lightning's
    ``convert_to_tensors``), in the same (nested) collection."""
    if isinstance(data, (bool, int, float)):
        return torch.tensor(data, device=device)
    if torch.is_tensor(data):
        return data.to(device)
    if type(data).__module__ == "numpy" and hasattr(data, "__array__"):
        return torch.as_tensor(data, device=device)
    return _map(data, lambda x: _to_tensors(x, device))


def _map(data: Any, fn: Any) -> Any:
    if isinstance(data, dict):
        return type(data)({k: fn(v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(fn(v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(fn(v) for v in data)
    return data


def _gather_tensor(t: torch.Tensor, group: Any, sync_grads: bool) -> torch.Tensor:
    """``(world, *t.shape)``: every rank's ``t`` stacked in rank order; through autograd's
    all_gather (gradients flow back to each rank's input) with ``sync_grads``."""
    from torch.distributed.nn.functional import all_gather

    progress.mark("all_gather (TrainModule.all_gather)")
    t = t.contiguous()
    if sync_grads:
        return torch.stack(all_gather(t, group))
    with torch.no_grad():
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
    return torch.stack(out)


def all_gather(data: Any, device: torch.device, distributed: bool, group: Any = None,
               sync_grads: bool = False) -> Any:
    """Lightning's ``all_gather``: every tensor (numbers become tensors) of a (nested)
    collection gathered from every rank of ``group`` (default: all) with a new leading
    dimension; one process (``distributed`` False): the tensors as they are. Collective: every
    rank calls it with the same shapes."""
    data = _to_tensors(data, device)
    if not distributed:
        return data
    group = group if group is not None else dist.group.WORLD

    def gather(x: Any) -> Any:
        return _gather_tensor(x, group, sync_grads) if torch.is_tensor(x) else _map(x, gather)

    return gather(data)
