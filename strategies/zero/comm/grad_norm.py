"""The total gradient norm of a ZeRO strategy, rounded exactly as ``torch.nn.utils.clip_grad_norm_``.

PyTorch's clipping (``get_total_norm``) takes each gradient tensor's 2-norm, then the 2-norm of
those norms stacked in the parameters' order. A squared sum over partitions, all-reduced, is the
same number in exact arithmetic but rounds differently in fp32, so a sharded run drifted from a
replicated one by a few ulps per clipped step. Here every rank computes the norms of the
parameters whose gradient lies wholly in its partition (from a view of it with the parameter's
shape), the few parameters cut by a partition boundary are assembled (one zero-padded all-reduce
each, adding zeros is exact) and normed on every rank, then one all-reduce of a zero-padded vector
of the per-parameter norms (each filled by one rank) gives every rank the same vector, and its norm
is the total PyTorch computes. Communication: one float per parameter plus the boundary tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .collectives import all_reduce_sum
from ..layout import GroupLayout

try:  # the test get_total_norm uses to pick the fused per-tensor norm (CUDA) or vector_norm (CPU)
    from torch.utils._foreach_utils import _has_foreach_support
except ImportError:  # pragma: no cover - older torch: per-tensor vector_norm
    def _has_foreach_support(tensors, device) -> bool:
        return False


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter's gradient in this rank's step-gradient slot ``slot``."""

    slot: int
    offset: int  # first element within the slot tensor
    param_start: int  # first element within the flattened parameter
    numel: int


@dataclass(frozen=True)
class ParamNorm:
    """One trainable parameter, in the optimizer's order: where its gradient lies."""

    group: int  # optimizer param group
    shape: torch.Size
    numel: int
    whole: bool  # lies in one rank's partition
    mine: tuple[LocalPiece, ...]  # the pieces in this rank's partition
    #: the group a boundary parameter is assembled over (None: ``exact_total_norm``'s; an
    #: expert's: its expert-data-parallel group, ``zero/experts.py``)
    comm: object = None
    #: whether this rank writes the boundary parameter's norm (None: ``exact_total_norm``'s ``leader``)
    lead: bool | None = None
    #: a tensor-parallel shard (parallel/tensor.py): its square is summed over ``exact_total_norm``'s
    #: ``tensor_group`` (each rank holds a different shard); a replicated parameter's counts once
    tensor_parallel: bool = False


def plan_param(group: int, shape: torch.Size, layout: GroupLayout, index: int, rank: int,
               locate: Callable[[int], tuple[int, int]]) -> ParamNorm:
    """Parameter ``index`` of ``layout``; ``locate(partition_start)`` gives the (slot, offset in
    slot) of an element of this rank's partition."""
    pieces = layout.pieces_of(index)
    mine = []
    for pc in pieces:
        if pc.rank == rank:
            slot, off = locate(pc.partition_start)
            mine.append(LocalPiece(slot, off, pc.param_start, pc.numel))
    return ParamNorm(group, torch.Size(shape), layout.spans[index].numel, len(pieces) <= 1, tuple(mine))


def tensor_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, by the kernel ``get_total_norm`` uses for tensors of this device."""
    if not tensors:
        return []
    if _has_foreach_support(tensors, tensors[0].device):
        return list(torch._foreach_norm(tensors, 2.0))
    return [torch.linalg.vector_norm(t, 2.0) for t in tensors]


#: ``read(ranges, visit)``: each ``(slot, first element, elements)`` of this rank's step-gradient
#: slots, given to ``visit(i, tensor)`` (any order)
Reader = Callable[[list[tuple[int, int, int]], Callable[[int, torch.Tensor], None]], None]


def slice_reader(grads: Sequence[torch.Tensor]) -> Reader:
    """Ranges of gradient slots held as tensors: views, no copy."""
    def read(ranges, visit):
        for i, (slot, off, n) in enumerate(ranges):
            visit(i, grads[slot][off:off + n])
    return read


def exact_total_norm(plan: Sequence[ParamNorm], read: Reader, groups: set[int] | None,
                     device: torch.device, complete: Callable, group: object = None,
                     leader: bool = True, tensor_group: object = None) -> torch.Tensor:
    """Collective: the 2-norm of the gradients of the parameters of optimizer groups ``groups``
    (all when None), as ``get_total_norm`` over the whole fp32 gradients. ``read``: this rank's
    step-gradient slots (``plan``'s slot indices); ``complete(handle, tensor, label)`` waits for a
    collective; ``leader``: this rank writes the boundary parameters' norms; ``tensor_group``: the
    tensor-parallel group over which the shards' squares are summed (None: no tensor axis)."""
    chosen = [p for p in plan if groups is None or p.group in groups]
    norms = torch.zeros(len(chosen), dtype=torch.float32, device=device)
    whole = [k for k, p in enumerate(chosen) if p.whole and p.mine]
    local: dict[int, torch.Tensor] = {}

    def keep(i: int, t: torch.Tensor) -> None:
        k = whole[i]
        t = _fp32(t).view(chosen[k].shape)
        if t.device.type == "cpu":  # no fused kernel there: one vector_norm each, as get_total_norm
            norms[k] = tensor_norms([t])[0].to(device)
        else:  # the fused per-tensor kernel over the device's tensors, as get_total_norm
            local[k] = t
    read([(chosen[k].mine[0].slot, chosen[k].mine[0].offset, chosen[k].numel) for k in whole], keep)
    if local:
        idx = list(local)
        norms[torch.tensor(idx, device=device)] = torch.stack(tensor_norms([local[k] for k in idx])).float()
    for k, p in enumerate(chosen):
        if p.whole:
            continue
        full = torch.zeros(p.numel, dtype=torch.float32, device=device)  # a boundary parameter

        def put(i: int, t: torch.Tensor, p: ParamNorm = p, full: torch.Tensor = full) -> None:
            full[p.mine[i].param_start:p.mine[i].param_start + p.mine[i].numel].copy_(t)
        read([(pc.slot, pc.offset, pc.numel) for pc in p.mine], put)
        complete(all_reduce_sum(full, group if p.comm is None else p.comm), full, "grad norm (boundary parameter)")
        if leader if p.lead is None else p.lead:
            norms[k] = tensor_norms([full.view(p.shape)])[0]
    complete(all_reduce_sum(norms, group), norms, "grad norm")
    if not chosen:
        return torch.zeros((), device=device)
    if tensor_group is None:
        return torch.linalg.vector_norm(norms, 2.0)
    sharded = torch.tensor([p.tensor_parallel for p in chosen], device=device)
    squares = norms.pow(2)
    across = squares[sharded].sum()
    complete(all_reduce_sum(across, tensor_group), across, "grad norm (tensor-parallel shards)")
    return (across + squares[~sharded].sum()).sqrt()


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.dtype == torch.float32 else t.detach().float()
