"""The sequence-parallel variant of tensor parallelism (Korthikanti et al., 2022, "Reducing
Activation Recomputation in Large Transformer Models"; torch's ``SequenceParallel`` style), and the
random numbers drawn on either side of it.

Between a row-parallel output and the next column-parallel input, the activations (the residual
stream, the norms' inputs and outputs, the dropouts') are cut along the sequence over the tensor
group, so each rank stores ``1/tp`` of them. The layers that move them are ``tensor.py``'s
(``colwise_sp`` gathers its input along the sequence, ``rowwise_sp`` reduce-scatters its output,
``embedding_rowwise_sp`` reduce-scatters the looked-up rows); the modules here run *on* the shard:

* :class:`SequenceParallelNorm`: a norm (``is_norm``: ``nn.LayerNorm``, an RMSNorm) on this rank's tokens. Its parameters stay replicated under the same
  names; each rank's gradient of them covers its own tokens only, so they enter the computation
  through ``copy_to_group``, whose backward sums the gradient over the group: every rank then holds
  the whole batch's gradient, as without sequence parallelism, and DDP / ZeRO reduce over the data
  replicas unchanged.
* :class:`SequenceParallelDropout`: an ``nn.Dropout`` on this rank's tokens. **Decision**: the mask
  is the one the plain model draws for those tokens: the whole ``[batch, sequence, ...]`` mask is
  drawn from the default generator exactly as ``nn.Dropout`` draws it (``torch.native_dropout``
  on a tensor of the whole shape: the same draw as ``F.dropout``'s, checked bit for bit on CPU in
  tests/unit/test_tensor_sequence.py), and this rank keeps its chunk. The tensor ranks' default
  generators go in lockstep (the same seed, the same draws), so the sequence-sharded model
  computes what the plain one does, dropout included. The cost: each rank draws the whole mask
  (a transient), while it stores only its chunk for backward.
* ``entry=True`` (style ``sequence_shard``): the module's input is still replicated (the GPT's
  ``drop(wte + wpe)``, positions added whole) and is cut here first (``scatter_to_sequence``).

Inside the tensor-parallel regions (between a column-parallel output and the row-parallel input:
attention probabilities over this rank's heads, an MLP's sharded hidden units) each rank must draw a
*different* mask, as Megatron's model-parallel RNG tracker does. :class:`TensorRNG` is that region:
``with module.tensor_rng(device):`` draws one seed from the default generator (the same on every rank,
so the streams stay in lockstep), seeds the default generator with it plus this rank's tensor index,
and restores the default generator's state (advanced by that one draw) on leaving. Decision: no
stream of its own (Megatron keeps a separately seeded one, checkpointed): the region's draws follow
from the default generator's state, which a checkpoint restores, so a resumed run draws the same
masks; and a region that draws nothing (dropout off, evaluation) need not be entered, so the default
stream is then exactly the plain model's. A module opts in by declaring ``tensor_rng = None``; the
cut (``tensor_plan.parallelize_tensor``) sets it (the demo GPT's attention does: its SDPA dropout).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .tensor import SEQ, copy_to_group, scatter_to_sequence


def sequence_dropout_mask(shard: torch.Tensor, p: float, size: int, rank: int) -> torch.Tensor:
    """The scaled dropout mask (0 or ``1/(1-p)``) of chunk ``rank`` of ``size`` along the sequence,
    drawn as ``nn.Dropout`` would draw the whole ``[batch, sequence * size, ...]`` activation's
    (the default generator of ``shard``'s device advances as it would there)."""
    whole = list(shard.shape)
    whole[SEQ] *= size
    ones = torch.ones(whole, dtype=shard.dtype, device=shard.device)
    scaled, _ = torch.native_dropout(ones, p, True)
    return scaled.chunk(size, dim=SEQ)[rank].clone(memory_format=torch.contiguous_format)  # not a view: the
    # whole mask is freed here, backward keeps this chunk only


def is_norm(module: nn.Module) -> bool:
    """A norm, as the sequence-parallel styles take it: a class named ``...Norm...`` (``nn.LayerNorm``,
    ``nn.RMSNorm``, a Hugging Face ``LlamaRMSNorm``) with parameters of its own and no submodules."""
    return ("norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False))
            and not any(True for _ in module.children()))


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class SequenceParallelDropout(nn.Module):
    """``nn.Dropout`` on this rank's sequence chunk, with the plain model's mask for those tokens
    (module doc); ``entry``: the input is replicated and cut here first."""

    def __init__(self, dropout: nn.Dropout, group, entry: bool = False) -> None:
        super().__init__()
        if type(dropout) is not nn.Dropout:
            raise ValueError(f"sequence parallel: {type(dropout).__name__} is not supported; valid: nn.Dropout, "
                             f"or a norm (a module with parameters of its own and no submodules)")
        self.p, self.group, self.entry = dropout.p, group, entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry:
            x = scatter_to_sequence(x, self.group)
        if not self.training or self.p == 0.0:
            return x
        size, rank = _group_size_rank(self.group)
        return x * sequence_dropout_mask(x, self.p, size, rank)

    def extra_repr(self) -> str:
        return f"p={self.p}, sequence-parallel" + (", entry" if self.entry else "")


class SequenceParallelNorm(nn.Module):
    """A norm run on this rank's sequence chunk (module doc), its parameters and buffers under the
    norm's own names; ``entry``: the input is replicated and cut here first."""

    def __init__(self, norm: nn.Module, group, entry: bool = False) -> None:
        super().__init__()
        if not is_norm(norm):
            raise ValueError(f"sequence parallel: {type(norm).__name__} is not a norm (a ...Norm class with "
                             f"parameters of its own, no submodules); valid: nn.LayerNorm, an RMSNorm, nn.Dropout")
        self.group, self.entry = group, entry
        self._norm = (norm,)  # held, not registered: its tensors are this module's, under the same names
        for name, p in norm.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in norm.named_buffers(recurse=False):
            self.register_buffer(name, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.entry:
            x = scatter_to_sequence(x, self.group)
        norm = self._norm[0]
        norm.train(self.training)
        tensors = {n: copy_to_group(p, self.group) for n, p in self.named_parameters(recurse=False)}
        tensors.update(self.named_buffers(recurse=False))
        return torch.func.functional_call(norm, tensors, (x,))

    def extra_repr(self) -> str:
        return f"{self._norm[0]!r}, sequence-parallel" + (", entry" if self.entry else "")


def sequence_parallel_module(module: nn.Module, group, entry: bool = False) -> nn.Module:
    """The sequence-parallel form of a dropout or a norm (style ``sequence_parallel``; ``entry``:
    ``sequence_shard``)."""
    if isinstance(module, nn.Dropout):
        return SequenceParallelDropout(module, group, entry)
    return SequenceParallelNorm(module, group, entry)


# ---------------------------------------------------------------------------- random numbers
class TensorRNG:
    """The tensor-parallel region's random numbers (module doc): ``with rng(device):`` the default
    generator of ``device`` draws a stream of this rank's own, and is restored on leaving."""

    OFFSET = 2718  # Megatron's offset of the model-parallel seed

    def __init__(self, group=None, rank: int | None = None) -> None:
        self.group = group
        self.rank = rank

    def _rank(self) -> int:
        return self.rank if self.rank is not None else dist.get_rank(self.group)

    @contextlib.contextmanager
    def __call__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        gen = (torch.default_generator if device.type == "cpu"
               else torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()])
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen, device=device).item())
        state = gen.get_state()
        gen.manual_seed(seed + self.OFFSET + self._rank())
        try:
            yield
        finally:
            gen.set_state(state)


def give_tensor_rng(model: nn.Module, group) -> None:
    """Every module of ``model`` that declares ``tensor_rng = None`` gets the region of ``group``."""
    for module in model.modules():
        if hasattr(module, "tensor_rng") and module.tensor_rng is None:
            module.tensor_rng = TensorRNG(group)
