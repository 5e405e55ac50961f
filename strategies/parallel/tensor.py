"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019) on plain local parameters: each rank of a
tensor group holds its shard of a layer's weight as an ordinary ``nn.Parameter``, and the
collectives over the group are autograd functions around the layer's local matmul:

* ``copy_to_group``: identity forward, all-reduce (sum) of the gradient backward (Megatron's
  ``f``): where a replicated activation enters a column-parallel layer;
* ``reduce_from_group``: all-reduce (sum) forward, identity backward (``g``): where a row-parallel
  layer's (or a vocabulary-parallel embedding's) partial results meet;
* ``gather_from_group``: all-gather along the last dimension forward, this rank's slice of the
  gradient backward: a column-parallel output wanted whole (``colwise_rep``).

The sequence-parallel variant (Korthikanti et al., 2022; ``tensor_sequence.py``) keeps the
activations between a row-parallel output and the next column-parallel input cut along the sequence
(dimension 1 of ``[batch, sequence, ...]``) over the group; three more pairs move them:

* ``scatter_to_sequence``: this rank's sequence chunk forward, all-gather of the gradient backward
  (a replicated activation entering the sequence-sharded region);
* ``column_from_sequence``: ``colwise_sp``'s layer: all-gather along the sequence, then the matmul,
  forward; reduce-scatter of the input's gradient backward. It keeps only the input's chunk for
  backward and gathers it again there (Megatron's sequence-parallel linear);
* ``reduce_scatter_to_sequence``: reduce-scatter along the sequence forward, all-gather backward
  (``rowwise_sp``, ``embedding_rowwise_sp``: partial sums meeting as sequence shards).

A sharded parameter carries ``tensor_parallel`` (a :class:`TensorShard`: the dimension it is cut
along, into how many packed blocks, over how many ranks), which ``full_tensor`` uses to gather it
back. Everything else (norms, biases of row-parallel layers, position embeddings) stays replicated
over the tensor group, and its gradient is the same on every rank of it (every rank computes the
same replicated activations, and ``copy_to_group`` sums the gradients that leave the sharded
regions), so a data-parallel strategy reduces every local parameter over the data group only, as it
would without tensor parallelism.

``vocab_parallel_cross_entropy`` computes the cross-entropy from vocabulary-sharded logits without
gathering them: the max, the sum of exponentials and the target's logit are all-reduced, ``[N]``
numbers each, never ``[N, V]``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(_size(ctx.group), dim=-1)[_rank(ctx.group)].contiguous(), None


#: the sequence dimension of the ``[batch, sequence, ...]`` activations the sequence-parallel layers cut
SEQ = 1
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _seq_size(x: torch.Tensor, group) -> int:
    size = _size(group)
    if x.dim() <= SEQ or x.shape[SEQ] % size:
        raise ValueError(f"sequence parallelism: an activation {tuple(x.shape)} does not cut along dimension {SEQ} "
                         f"(the sequence) into {size} tensor ranks; valid: [batch, sequence, ...] with the sequence "
                         f"a multiple of {size}")
    return size


def _seq_chunk(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(_seq_size(x, group), dim=SEQ)[_rank(group)].clone(memory_format=torch.contiguous_format)


def _seq_gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=SEQ)


def _seq_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = _seq_size(x, group)
    whole = x.movedim(SEQ, 0).contiguous()  # the ranks' chunks contiguous, one after another
    out = whole.new_empty((whole.shape[0] // size, *whole.shape[1:]))
    _reduce_scatter_single(out, whole, group=group)
    return out.movedim(0, SEQ).contiguous()


class _SequenceMove(torch.autograd.Function):
    """``there(x, group)`` forward, ``back(grad, group)`` backward: one of the sequence moves' pairs."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.group), None, None, None


class _ColumnFromSequence(torch.autograd.Function):
    """``colwise_sp``'s layer: ``F.linear`` of the input gathered along the sequence, keeping only
    this rank's sequence chunk for backward, where it is gathered again (Megatron's sequence-parallel
    linear): the layer's saved input is ``1/tp`` of the whole. Under autocast the matmuls run in its
    dtype, as ``F.linear`` would, and the gradients return in the inputs' own dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.group, ctx.cast, ctx.bias_dtype = group, cast, bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight)
        whole = _seq_gather(x, group)
        with torch.autocast(device, enabled=False):
            if cast is not None:
                whole, weight = whole.to(cast), weight.to(cast)
                bias = bias.to(cast) if bias is not None else None
            return F.linear(whole, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(ctx.cast) if ctx.cast is not None else weight
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = _seq_reduce_scatter(grad.matmul(w).to(x.dtype), ctx.group)  # summed in the input's dtype
        rows = grad.reshape(-1, grad.shape[-1])
        if need_w:
            whole = _seq_gather(x, ctx.group)  # gathered again: only the chunk was kept
            whole = whole.to(ctx.cast) if ctx.cast is not None else whole
            grad_w = rows.t().mm(whole.reshape(-1, whole.shape[-1])).to(weight.dtype)
        if need_b and ctx.bias_dtype is not None:
            grad_b = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


def column_from_sequence(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    return _ColumnFromSequence.apply(x, weight, bias, group)


def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _SequenceMove.apply(x, group, _seq_chunk, _seq_gather)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    return _SequenceMove.apply(x, group, _seq_reduce_scatter, _seq_gather)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromGroup.apply(x, group)


# ---------------------------------------------------------------------------- shards
@dataclasses.dataclass(frozen=True)
class TensorShard:
    """How a local parameter is cut from the whole one: along ``dim``, the whole being ``chunks``
    packed blocks along it (a fused q/k/v projection: 3), each block split into ``size`` equal parts,
    this rank holding part ``rank`` of every block."""
    dim: int
    size: int
    rank: int
    chunks: int = 1

    def cut(self, whole: torch.Tensor) -> torch.Tensor:
        n = whole.shape[self.dim]
        if n % (self.chunks * self.size):
            raise ValueError(f"tensor parallel: dimension {self.dim} of a {tuple(whole.shape)} weight ({n}) does "
                             f"not divide into {self.chunks} block(s) x {self.size} ranks")
        blocks = whole.chunk(self.chunks, dim=self.dim)
        return torch.cat([b.chunk(self.size, dim=self.dim)[self.rank] for b in blocks], dim=self.dim).clone()

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's part (in rank order)."""
        per_rank = [p.chunk(self.chunks, dim=self.dim) for p in parts]
        return torch.cat([per_rank[r][c] for c in range(self.chunks) for r in range(self.size)], dim=self.dim)


def shard_parameter(param: nn.Parameter, shard: TensorShard) -> nn.Parameter:
    local = nn.Parameter(shard.cut(param.detach()), requires_grad=param.requires_grad)
    local.tensor_parallel = shard
    return local


def full_tensor(param: torch.Tensor, group) -> torch.Tensor:
    """The whole of a (possibly) tensor-parallel parameter or gradient: gathered over ``group`` where
    the parameter is sharded, itself otherwise. Pass the parameter, or ``(param, tensor)`` to gather
    a tensor shaped like it (its gradient)."""
    param, tensor = param if isinstance(param, tuple) else (param, param)
    shard = getattr(param, "tensor_parallel", None)
    if shard is None:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(shard.size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return shard.join(parts)


def tensor_parallel_norm(params, grads, group) -> torch.Tensor:
    """The L2 norm of the whole model's ``grads`` (those of ``params`` a step uses) where some
    parameters are tensor-parallel: their squares summed over ``group``, the replicated ones'
    (equal on every rank of it) counted once. Each part as ``torch.nn.utils.get_total_norm``."""
    grads = {id(g) for g in grads}
    sharded, replicated = [], []
    for p in params:
        if p.grad is not None and id(p.grad) in grads:
            (sharded if hasattr(p, "tensor_parallel") else replicated).append(p.grad.detach().float())
    zero = torch.zeros((), device=next(iter([*sharded, *replicated]), torch.zeros(())).device)
    sq = torch.nn.utils.get_total_norm(sharded) ** 2 if sharded else zero.clone()
    dist.all_reduce(sq, group=group)
    return (sq + (torch.nn.utils.get_total_norm(replicated) ** 2 if replicated else zero)).sqrt()


# ---------------------------------------------------------------------------- layers
class ParallelLinear(nn.Module):
    """A ``nn.Linear`` cut over a tensor group, its parameters under the same names.

    ``style``: ``colwise`` (output features split; the input replicated, the output this rank's
    features), ``colwise_rep`` (the same, the output gathered whole), ``rowwise`` (input features
    split; the input this rank's features, the output summed over the group, the bias added once
    after), ``rowwise_rep`` (the same from a replicated input, of which the layer takes its slice).
    Sequence-parallel: ``colwise_sp`` (as ``colwise`` from an input cut along the sequence, gathered
    first), ``rowwise_sp`` (as ``rowwise``, the sum reduce-scattered along the sequence; the
    replicated bias added to the shard, its gradient summed over the group)."""

    STYLES = ("colwise", "colwise_rep", "rowwise", "rowwise_rep", "colwise_sp", "rowwise_sp")

    def __init__(self, linear: nn.Linear, style: str, group, chunks: int = 1, shared: dict | None = None) -> None:
        super().__init__()
        if style not in self.STYLES:
            raise ValueError(f"ParallelLinear: style={style!r}; valid: {', '.join(self.STYLES)}")
        self.style, self.group = style, group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        size, rank = _size(group), _rank(group)
        col = style.startswith("colwise")
        if not col and chunks != 1:
            raise ValueError(f"ParallelLinear: packed blocks (chunks={chunks}) are for colwise layers only")
        self.weight = _shared(linear.weight, TensorShard(0 if col else 1, size, rank, chunks), shared)
        bias = linear.bias
        if bias is not None:
            bias = _shared(bias, TensorShard(0, size, rank, chunks), shared) if col else bias
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style.startswith("colwise"):
            if self.style == "colwise_sp":  # the input's sequence chunk kept for backward, gathered again there
                y = column_from_sequence(x, self.weight, self.bias, self.group)
            else:
                y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
            return gather_from_group(y, self.group) if self.style == "colwise_rep" else y
        if self.style == "rowwise_rep":
            x = x.chunk(_size(self.group), dim=-1)[_rank(self.group)]
        if self.style == "rowwise_sp":  # each rank adds the bias to its own tokens: their gradients summed
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.group)
            return y if self.bias is None else y + copy_to_group(self.bias, self.group)
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, style={self.style}, local={tuple(self.weight.shape)}"


class VocabParallelEmbedding(nn.Module):
    """A ``nn.Embedding`` whose rows (the vocabulary) are cut over a tensor group: each rank looks
    up the ids in its range, zeros elsewhere, and the group's sum is every id's row
    (``sequence_output``: reduce-scattered along the sequence, each rank its tokens' rows)."""

    def __init__(self, embedding: nn.Embedding, group, shared: dict | None = None, sequence_output: bool = False) -> None:
        super().__init__()
        self.sequence_output = sequence_output
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding: max_norm and sparse embeddings are not supported")
        self.group, self.padding_idx = group, embedding.padding_idx
        self.num_embeddings = embedding.num_embeddings
        self.weight = _shared(embedding.weight, TensorShard(0, _size(group), _rank(group)), shared)
        self.start = _rank(group) * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (reduce_scatter_to_sequence if self.sequence_output else reduce_from_group)(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, local={tuple(self.weight.shape)}, rows from {self.start}"


def _shared(param: nn.Parameter, shard: TensorShard, shared: dict | None) -> nn.Parameter:
    """The local shard of ``param``; a parameter shared by two modules (tied embedding and LM head)
    is cut once, and both get the same local Parameter (refused if they cut it differently)."""
    if shared is None:
        return shard_parameter(param, shard)
    key = id(param)
    if key in shared:
        local = shared[key]
        if local.tensor_parallel != shard:
            raise ValueError(f"tensor parallel: a parameter shared by two modules is cut two ways "
                             f"({local.tensor_parallel} and {shard}); valid: the same cut (tied embedding "
                             f"and LM head: embedding_rowwise with colwise)")
        return local
    shared[key] = shard_parameter(param, shard)
    return shared[key]


# ---------------------------------------------------------------------------- the loss
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index):
        logits = logits.float()
        vl = logits.shape[-1]
        start = _rank(group) * vl
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - top.unsqueeze(-1)).exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - start
        mine = (local >= 0) & (local < vl)
        index = local.clamp(0, vl - 1).unsqueeze(-1)
        picked = torch.where(mine, logits.gather(-1, index).squeeze(-1) - top, torch.zeros_like(top))
        dist.all_reduce(picked, group=group)
        kept = targets != ignore_index
        loss = torch.where(kept, total.log() - picked, torch.zeros_like(picked))
        ctx.save_for_backward(exp, total, index, mine & kept, kept)
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp, total, index, mine, kept = ctx.saved_tensors
        g = exp / total.unsqueeze(-1)
        g.scatter_add_(-1, index, -mine.to(g.dtype).unsqueeze(-1))
        g = g * (grad * kept).unsqueeze(-1)
        return g, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of logits whose last dimension (the vocabulary) is cut over ``group``
    (rank r holds classes ``[r*V/tp, (r+1)*V/tp)``, as a ``colwise`` LM head gives them), without
    gathering them. ``logits`` ``[..., V/tp]``, ``targets`` ``[...]`` (``ignore_index`` skipped);
    ``reduction``: mean (over the targets kept), sum or none. Every rank gets the same loss."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; valid: mean, sum, none")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)}; valid: targets shaped as the logits without their last dimension")
    loss = _VocabParallelCE.apply(logits, targets, group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (targets != ignore_index).sum()
