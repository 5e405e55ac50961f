"""Per-rank memory on a device mesh (issue 45): how the data, sequence, tensor and pipeline axes
divide a model's states and its activations. Pure arithmetic, as ``formula.py``.

* **tensor** (``t``): the parameters a tensor-parallel plan cuts (``sharded``: the demo GPT's
  ``GPT.tp_plan`` cuts q/k/v, both projections of attention and MLP, the vocabulary of the tied
  embedding/head, and the column-parallel biases) are ``1/t`` per rank, with their gradients, masters
  and optimizer state; the others (norms, position embeddings, row-parallel biases) stay whole.
* **data x sequence** (``r = d * s``): a rank's *replicas*, the ranks holding the same local
  parameters (``parallel.ParallelMesh.replicas``). ZeRO partitions over them and DDP averages
  over them, so ZeRO-k's partitioned states are ``1/(d * s)`` of the rank's local parameters.
* **pipeline** (``p`` stages): a rank holds its stage's layers; counted here as ``1/p`` of the local
  parameters (the mean stage: the pipeline's cut decides each stage's own share).
* **activations**: what autograd saves in one forward of the demo GPT (dropout 0, no activation
  checkpointing), per token of the rank's sequence shard; the sequence axis divides the tokens,
  the tensor axis the per-head and MLP-hidden tensors. Exact for fp32 (counted as the distinct
  storages that ``torch.autograd.graph.saved_tensors_hooks`` sees, parameters left out:
  ``tests/unit/test_mesh_estimate.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .formula import ModelStates, estimate_model_states

#: the axes of a mesh estimate, outermost first, with the CLI's option of each
MESH_AXES = ("data", "sequence", "tensor", "stages")


@dataclass(frozen=True)
class ParamSplit:
    """A whole model's parameter elements: those its tensor plan cuts, and the rest."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def local(self, tensor: int = 1, stages: int = 1) -> int:
        """Elements one rank holds before any ZeRO partitioning."""
        return math.ceil((math.ceil(self.sharded / tensor) + self.replicated) / stages)


def gpt_param_split(n_layer: int, n_embd: int, vocab_size: int, block_size: int = 1024,
                    bias: bool = True) -> ParamSplit:
    """The demo GPT's parameters (tied head) split by ``GPT.tp_plan``: q/k/v and the MLP's first
    projection column-wise (weights and biases cut), both second projections row-wise (weights
    cut, biases whole), the embedding by vocabulary; position embeddings and LayerNorms whole."""
    d = n_embd
    ln = 2 * d if bias else d
    sharded = vocab_size * d + n_layer * (12 * d * d + (7 * d if bias else 0))
    replicated = block_size * d + n_layer * (2 * ln + (2 * d if bias else 0)) + ln
    return ParamSplit(sharded, replicated)


def mesh_model_states(split: ParamSplit, data: int = 1, sequence: int = 1, tensor: int = 1, stages: int = 1,
                      precision: str = "bf16-mixed", optimizer_bytes: int | None = None) -> dict[str, ModelStates]:
    """Per-rank model-state bytes of every ZeRO stage (``formula.estimate_model_states``'s shape)
    on a ``data x sequence x tensor`` mesh of ``stages`` pipeline stages: the rank's local
    parameters (:meth:`ParamSplit.local`) distributed over its ``data * sequence`` replicas."""
    for axis, size in zip(MESH_AXES, (data, sequence, tensor, stages)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{axis}={size!r}; valid: a whole number >= 1")
    return estimate_model_states(split.local(tensor, stages), data * sequence, precision,
                                 optimizer_bytes=optimizer_bytes)


def gpt_activation_bytes(batch: int, seq: int, n_layer: int, n_embd: int, n_head: int, vocab_size: int,
                         tensor: int = 1, sequence: int = 1, element_bytes: int = 4, loss: bool = True,
                         tensor_sequence: bool = False) -> int:
    """Bytes autograd keeps for backward after one forward of the demo GPT on ``batch`` sequences
    of ``seq`` tokens, on one rank: its ``seq / sequence`` tokens (Ulysses), ``1/tensor`` of the
    heads and of the MLP's hidden units (Megatron). Per layer and token, in elements: the block's
    input, the attention's residual sum, both LayerNorm outputs (``4C``, whole on every tensor
    rank) and each norm's mean and rstd (4); q/k/v (``3C``), the attention output (``C``) and its
    log-sum-exp (one per head), the MLP's hidden before and after GELU (``8C``), all cut by the
    tensor axis; under Ulysses the attention's output is exchanged back into a second tensor
    (``C``). After the blocks: the final norm's input and output (``2C + 2``) and the logits
    (``V``, cut by the tensor axis); int64 token ids (under a tensor axis: the vocabulary-parallel
    embedding's local ids and its out-of-range mask, one byte) and targets; the positions; the loss.
    ``loss=False``: the forward to the logits only (no targets, no log-softmax, no loss).
    ``tensor_sequence``: the sequence-parallel variant of tensor parallelism (``GPTConfig.tp_sequence_parallel``):
    the residual stream and the norms are cut along the sequence too, and a column-parallel layer keeps
    its input's sequence chunk (gathering it again in backward), so the whole ``4C + 4`` per layer
    (``2C + 2`` for the final norm) is cut by the tensor axis as well: every activation is ``1/tensor``.
    ``element_bytes``: 4 in fp32 (exact), 2 approximates bf16 activations."""
    for name, v in (("batch", batch), ("seq", seq), ("n_layer", n_layer), ("n_embd", n_embd), ("n_head", n_head),
                    ("vocab_size", vocab_size), ("tensor", tensor), ("sequence", sequence)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}; valid: a whole number >= 1")
    if seq % sequence:
        raise ValueError(f"sequence={sequence}; valid: a divisor of seq={seq}")
    for name, v in (("n_head", n_head), ("vocab_size", vocab_size), ("n_embd", n_embd)):
        if v % tensor:
            raise ValueError(f"tensor={tensor}; valid: a divisor of {name}={v}")
    c, t, e = n_embd, tensor, element_bytes
    tokens = batch * seq // sequence
    cut = 12 * c + n_head + (c if sequence > 1 else 0)
    whole, norm = (0, 4 * c + 4) if tensor_sequence and t > 1 else (4 * c + 4, 0)  # per layer: whole, cut
    layer = whole * e + (cut + norm) * e // t
    ids = 8 + (1 if t > 1 else 0)
    final = (0, 2 * c + 2) if tensor_sequence and t > 1 else (2 * c + 2, 0)
    head = final[0] * e + final[1] * e // t + ids + ((vocab_size // t) * e + 8 if loss else 0)  # ln_f; logits
    return tokens * (n_layer * layer + head) + 8 * (seq // sequence) + (4 if loss else 0)  # positions, loss


def format_mesh_table(split: ParamSplit, world_sizes, *, sequence: int = 1, tensor: int = 1, stages: int = 1,
                      precision: str = "bf16-mixed", optimizer_bytes: int = 8, activations=None) -> str:
    """``zerotrain-estimate --tensor-parallel t --sequence-parallel s --stages p``: per-rank bytes
    of each state and of the activations for every world size (the data axis is what remains).
    ``activations(tensor, sequence) -> bytes`` (None: not estimated, e.g. a model given by its
    parameter count)."""
    from .formula import format_bytes

    act = activations(tensor, sequence) if activations is not None and stages == 1 else None
    lines = [f"Per rank on a mesh, {split.total:,} parameters ({split.sharded:,} cut by the tensor plan, "
             f"{split.replicated:,} whole), precision {precision}, optimizer {optimizer_bytes} bytes/param",
             f"tensor={tensor}: 1/{tensor} of the cut parameters, their gradients and optimizer state, and of the "
             f"heads' and MLP's activations; sequence={sequence}: 1/{sequence} of the activations' tokens, "
             f"and a replica axis as data; stages={stages}: "
             + ("one stage's layers (the mean stage)" if stages > 1 else "the whole model"),
             f"{'ranks':>6} {'mesh d x s x t x p':>20} {'stage':>6} {'params':>12} {'grads':>12} {'master':>12} "
             f"{'optimizer':>12} {'activations':>12} {'total':>12}"]
    for n in world_sizes:
        data = n // (sequence * tensor * stages)
        shape = f"{data}x{sequence}x{tensor}x{stages}"
        for stage, s in mesh_model_states(split, data, sequence, tensor, stages, precision, optimizer_bytes).items():
            if stages > 1 and stage not in ("ddp", "zero1"):
                continue  # the pipeline runs ZeRO-1 at most
            cells = [s.params, s.grads, s.master, s.optimizer]
            lines.append(f"{n:>6} {shape:>20} {stage:>6} " + " ".join(f"{format_bytes(v):>12}" for v in cells)
                         + f" {format_bytes(act) if act is not None else '-':>12} "
                         + f"{format_bytes(s.total + (act or 0)):>12}")
    lines.append("ZeRO partitions over a rank's data x sequence replicas. Activations: what one forward saves "
                 "for backward (no activation checkpointing; "
                 + ("exact in fp32" if precision == "32" else "2 bytes/element, approximate under mixed precision")
                 + ("" if act is not None else "; '-': needs a GPT config and one stage") + "). Communication "
                 "buckets, temporary buffers and allocator slack come on top.")
    return "\n".join(lines)
