"""Tensor parallelism for Hugging Face's ``Conv1D`` (``transformers.pytorch_utils.Conv1D``: GPT-2's
projections), a linear layer ``y = x @ W + b`` whose weight is stored transposed, ``[in, out]``
(``nx``, ``nf``). ``ParallelConv1D`` cuts it as ``tensor.ParallelLinear`` cuts an ``nn.Linear`` and
keeps the layout: column-parallel cuts the weight's dimension 1 (and the bias), row-parallel its
dimension 0 (the bias stays whole, added once after the sum). Known by its class name and shape,
so transformers is not imported.
"""
from __future__ import annotations

import torch
from torch import nn

from .tensor import TensorShard, _rank, _shared, _size, copy_to_group, gather_from_group, reduce_from_group


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face ``Conv1D``: so named, its weight ``[nx, nf]``."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


def linear_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


class ParallelConv1D(nn.Module):
    """A ``Conv1D`` cut over a tensor group, its parameters under the same names and in its layout.

    ``style``: ``colwise`` (output features split: weight ``[in, out/tp]``, bias ``[out/tp]``;
    ``chunks`` packed blocks each split, as a fused ``[q | k | v]``), ``colwise_rep`` (the output
    gathered whole), ``rowwise`` (input features split: weight ``[in/tp, out]``, the partial results
    summed over the group, the whole bias added after), ``rowwise_rep`` (the same from a replicated
    input, of which the layer takes its slice). The sequence-parallel styles are not built for it."""

    STYLES = ("colwise", "colwise_rep", "rowwise", "rowwise_rep")

    def __init__(self, conv: nn.Module, style: str, group, chunks: int = 1, shared: dict | None = None) -> None:
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"ParallelConv1D: style={style!r}; valid: {', '.join(self.STYLES)} (the sequence-parallel "
                             f"styles are built for nn.Linear only)")
        col = style.startswith("colwise")
        if not col and chunks != 1:
            raise ValueError(f"ParallelConv1D: packed blocks (chunks={chunks}) are for colwise layers only")
        self.style, self.group = style, group
        self.nx, self.nf = conv.nx, conv.nf
        size, rank = _size(group), _rank(group)
        self.weight = _shared(conv.weight, TensorShard(1 if col else 0, size, rank, chunks), shared)
        bias = conv.bias
        if bias is not None and col:
            bias = _shared(bias, TensorShard(0, size, rank, chunks), shared)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style.startswith("colwise"):
            rows = copy_to_group(x, self.group).reshape(-1, x.shape[-1])
            y = torch.addmm(self.bias, rows, self.weight) if self.bias is not None else rows.mm(self.weight)
            y = y.view(*x.shape[:-1], -1)
            return gather_from_group(y, self.group) if self.style == "colwise_rep" else y
        if self.style == "rowwise_rep":
            x = x.chunk(_size(self.group), dim=-1)[_rank(self.group)]
        y = reduce_from_group(x.reshape(-1, x.shape[-1]).mm(self.weight), self.group).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, style={self.style}, local={tuple(self.weight.shape)}"
