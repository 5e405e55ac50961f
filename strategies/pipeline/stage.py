"""StageExecutor: runs one stage's instruction list for one global batch.

It owns the per-step buffers (inputs received or loaded, outputs awaiting their backward, output
gradients received, targets) keyed by micro-batch, and frees each as soon as the schedule is done
with it, so the number of micro-batches whose activations are alive follows the schedule
(``StepStats.peak_live``). Communication goes through ``PipeComm``; consecutive communication
instructions form one exchange (``schedule.steps``), posted together and waited on together.

The last stage computes ``loss_fn(outputs, targets) / micro_batches`` in its forward, so that the
summed micro-batch gradients are those of the mean loss, exactly as without pipelining. Parts of
unequal size (an evaluation batch whose rows ``micro_batches`` does not divide; the strategy
refuses such a training batch) are weighted by their share of the rows instead, and each part's
activation layout is named by its own shapes (``input_key``).

With virtual stages (interleaved 1F1B) the stage holds several chunks: buffers are keyed by
``(chunk, micro-batch)``, each forward runs its chunk's layers (``PipelineModule.forward_chunk``),
the ends are chunk 0 of stage 0 and the last chunk of the last stage, and each stage boundary of
the deeper pipeline (virtual stage ``v`` -> ``v + 1``) has its own cached layout per micro-batch
input shapes (``_sent_key``: unequal evaluation parts cross a boundary in two layouts).

Forward and backward go through the strategy's and the precision plugin's one copy of each:
every micro-batch forward runs through ``run_forward`` (the strategy's, which enters the
precision's forward context); the last stage's backward is the plugin's ``backward_loss`` (the
same call as ``Strategy.backward``'s: loss scale, autograd), and the other stages' backward from
the received output gradients (already scaled) is the plugin's ``backward`` alone.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..precision import Precision
from .module import PipelineModule
from .p2p import GRAD_TAG, ActivationMeta, PipeComm
from .schedule import (Backward, Forward, Instruction, LoadMicroBatch, RecvActivation, RecvGrad,
                       SendActivation, SendGrad, WeightGrad, is_comm, steps)
from .weight_grad import DeferWeightGrads, apply_weight_grads


@dataclass
class StepStats:
    """What one run of a schedule did on this stage (host-side times)."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    wall_s: float = 0.0
    peak_live: int = 0  # most micro-batches whose activations were held at once


@dataclass
class _Buffers:
    keys: list[Hashable]  # each micro-batch's layout name
    micro_inputs: Sequence[Any]
    micro_targets: Sequence[Any]
    train: bool
    grad_scale: float = 1.0
    inputs: dict[int, Any] = field(default_factory=dict)
    targets: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    grads: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    #: split backward (the schedule has ``WeightGrad``s): each micro-batch's deferred weight gradients
    split: bool = False
    weight_stash: dict[int, list] = field(default_factory=dict)
    loss_sum: torch.Tensor | None = None
    live: int = 0


def input_key(micro_input: Any, train: bool) -> Hashable:
    """What every stage of a replica can compute alone to name a layout: mode + input shapes."""
    items = micro_input if isinstance(micro_input, (tuple, list)) else (micro_input,)
    return (train, tuple((tuple(t.shape), t.dtype) if torch.is_tensor(t) else repr(t) for t in items))


def _rows_of(target: Any) -> int:
    return _rows_of(target[0]) if isinstance(target, (tuple, list)) else int(target.shape[0])


def _share_of_loss(loss: torch.Tensor, target: Any, micro_targets: Sequence[Any]) -> torch.Tensor:
    """One micro-batch's part of the batch's mean loss: ``loss / m`` for equal parts (bit for bit
    what it always was), else ``loss`` x its share of the rows."""
    rows = [_rows_of(t) for t in micro_targets]
    if len(set(rows)) == 1:
        return loss / len(rows)
    return loss * (_rows_of(target) / sum(rows))


def batch_rows(value: Any, what: str) -> int:
    """Rows (dim 0) of a tensor, or of the first tensor of a tuple (``what`` names it in the error)."""
    if isinstance(value, (tuple, list)) and value:
        return batch_rows(value[0], what)
    if not torch.is_tensor(value) or value.dim() == 0:
        raise TypeError(f"pipeline: {what} must be tensors with a batch dimension or tuples of them, got "
                        f"{type(value).__name__}")
    return value.shape[0]


def split_micro_batches(value: Any, what: str, parts: int, train: bool, device: torch.device) -> list[Any]:
    """``value`` (a tensor, or nested tuples of them) in ``parts`` micro-batches along dim 0, on
    ``device``; a training batch must divide evenly (``PipelineStrategy.split_batch``)."""
    from ...trainer.errors import ConfigError

    if isinstance(value, (tuple, list)):
        pieces = [split_micro_batches(v, what, parts, train, device) for v in value]
        return [tuple(p[i] for p in pieces) for i in range(parts)]
    rows = batch_rows(value, what)
    if train and rows % parts:
        raise ConfigError(f"pipeline: a training batch of {rows} rows cannot be split into "
                          f"micro_batches={parts} equal parts; valid: a batch size (per data-parallel "
                          f"replica) divisible by {parts}, with drop_last=True")
    return [c.to(device) for c in value.tensor_split(parts)]


class StageExecutor:
    def __init__(self, pipe: PipelineModule, num_stages: int, comm: PipeComm | None,
                 precision: Precision, device: torch.device, run_forward: Callable[..., Any],
                 activation_checkpointing: bool = False) -> None:
        """``run_forward(fn, *args)``: the strategy's, which runs ``fn`` under the precision's
        forward context."""
        self.pipe, self.num_stages, self.comm = pipe, num_stages, comm
        self.stage = pipe.stage
        self.virtual_stages = pipe.virtual_stages
        self.first, self.last = self.stage == 0, self.stage == num_stages - 1
        self.precision, self.device, self.run_forward = precision, device, run_forward
        self.activation_checkpointing = activation_checkpointing
        self.stats = StepStats()

    def run(self, instructions: list[Instruction], micro_inputs: Sequence[Any],
            micro_targets: Sequence[Any], train: bool, grad_scale: float = 1.0) -> torch.Tensor:
        """Execute ``instructions``; returns the summed (already 1/m-scaled) micro-batch losses on
        the last stage and 0 elsewhere. Gradients are those of ``grad_scale`` x that loss (the
        Trainer's 1/accumulate_grad_batches)."""
        if self.is_last(self.virtual_stages - 1) and self.pipe.loss_fn is None:
            raise ValueError("pipeline: the PipelineModule has no loss_fn; pass loss_fn=... so the last "
                             "stage can compute the loss")
        b = _Buffers([input_key(x, train) for x in micro_inputs], micro_inputs, micro_targets, train, grad_scale,
                     split=train and any(isinstance(ins, WeightGrad) for ins in instructions))
        self.stats = StepStats()
        start = time.perf_counter()
        for step in steps(instructions):
            t0 = time.perf_counter()
            if isinstance(step, list):
                inside = self._exchange(step, b)  # compute run while the exchange was in flight
                self.stats.compute_s += inside
                self.stats.comm_s += time.perf_counter() - t0 - inside
            else:
                self._compute(step, b)
                self.stats.compute_s += time.perf_counter() - t0
        self.stats.wall_s = time.perf_counter() - start
        leftover = [name for name in ("inputs", "outputs", "grads", "weight_stash") if getattr(b, name)]
        assert not leftover, f"schedule left buffers behind: {leftover}"
        if b.loss_sum is None:
            return torch.zeros((), device=self.device)
        return b.loss_sum

    # ------------------------------------------------------------------ chunks
    def is_first(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the pipeline's first (it loads the inputs)."""
        return self.first and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the pipeline's last (targets and loss)."""
        return self.last and chunk == self.virtual_stages - 1

    def _sent_key(self, b: _Buffers, chunk: int, mb: int) -> Hashable:
        """The cached layout of what ``chunk`` sends on for micro-batch ``mb``: its boundary in the
        deeper pipeline and that micro-batch's input shapes (unequal evaluation parts differ)."""
        return b.keys[mb], chunk * self.num_stages + self.stage

    def _received_key(self, b: _Buffers, chunk: int, mb: int) -> Hashable:
        return b.keys[mb], chunk * self.num_stages + self.stage - 1

    # ------------------------------------------------------------------ compute
    def _compute(self, ins: Instruction, b: _Buffers) -> None:
        slot = (ins.chunk, ins.mb)
        if isinstance(ins, LoadMicroBatch):
            if self.is_first(ins.chunk):
                b.inputs[slot] = b.micro_inputs[ins.mb]
            if self.is_last(ins.chunk):
                b.targets[slot] = b.micro_targets[ins.mb]
        elif isinstance(ins, Forward):
            self._forward(slot, b)
        elif isinstance(ins, Backward):
            self._backward(slot, b)
        elif isinstance(ins, WeightGrad):
            apply_weight_grads(b.weight_stash.pop(slot))
        else:
            raise TypeError(f"not a compute instruction: {ins!r}")

    def _forward(self, slot: tuple[int, int], b: _Buffers) -> None:
        chunk, last = slot[0], self.is_last(slot[0])
        x = b.inputs[slot] if b.train and not self.is_first(chunk) else b.inputs.pop(slot)
        target = b.targets.pop(slot) if last else None
        with torch.set_grad_enabled(b.train):
            out = self.run_forward(self._stage_forward, x, target, b, slot)
        if last:
            loss = out.detach().float()
            b.loss_sum = loss if b.loss_sum is None else b.loss_sum + loss
            if not b.train:
                return
        b.outputs[slot] = out
        if b.train:
            b.live += 1
            self.stats.peak_live = max(self.stats.peak_live, b.live)

    def _stage_forward(self, x: Any, target: Any, b: _Buffers, slot: tuple[int, int]) -> Any:
        """This stage's layers (of one chunk) on one micro-batch; on the last, its share of the loss."""
        chunk = slot[0]
        layers = self.pipe if self.virtual_stages == 1 else functools.partial(self.pipe.forward_chunk, chunk)
        if b.split:  # every leaf-weight linear's weight gradient waits for the WeightGrad instruction
            with DeferWeightGrads(b.weight_stash.setdefault(slot, [])):
                return self._layers_and_loss(layers, x, target, b, chunk)
        return self._layers_and_loss(layers, x, target, b, chunk)

    def _layers_and_loss(self, layers: Callable[[Any], Any], x: Any, target: Any, b: _Buffers, chunk: int) -> Any:
        if b.train and self.activation_checkpointing:
            out = checkpoint(layers, x, use_reentrant=False)
        else:
            out = layers(x)
        if self.is_last(chunk):
            out = _share_of_loss(self.pipe.loss_fn(out, target), target, b.micro_targets)
        return out

    def _backward(self, slot: tuple[int, int], b: _Buffers) -> None:
        out = b.outputs.pop(slot)
        if self.is_last(slot[0]):
            self.precision.backward_loss(out * b.grad_scale if b.grad_scale != 1.0 else out, self.pipe)
        else:
            meta = self.comm.sent[self._sent_key(b, *slot)]
            tensors = meta.flatten(out)
            grads = b.grads.pop(slot)
            if grads:
                self.precision.backward([tensors[i] for i in meta.grad_positions], self.pipe, grads)
        b.live -= 1

    # ------------------------------------------------------------------ communication
    def _exchange(self, exchange: list[Instruction], b: _Buffers) -> float:
        """Post the exchange's operations, run its overlapped compute, wait; returns the seconds
        that compute took."""
        comm = self.comm
        # layouts first, posted together (only the first exchange of a boundary and shape has any)
        comm.exchange_headers(
            [(self._sent_key(b, i.chunk, i.mb), ActivationMeta.of(b.outputs[(i.chunk, i.mb)]))
             for i in exchange if isinstance(i, SendActivation)],
            [self._received_key(b, i.chunk, i.mb) for i in exchange if isinstance(i, RecvActivation)])
        sends, recvs, landed, overlapped = [], [], [], []
        for ins in exchange:
            if not is_comm(ins):  # computed while the exchange is in flight
                overlapped.append(ins)
                continue
            slot = (ins.chunk, ins.mb)
            if isinstance(ins, SendActivation):
                out = b.outputs[slot] if b.train else b.outputs.pop(slot)
                sends.append((comm.sent[self._sent_key(b, *slot)].flatten(out), comm.next_rank))
            elif isinstance(ins, RecvActivation):
                bufs = comm.received[self._received_key(b, *slot)].empty(self.device)
                recvs.append((bufs, comm.prev_rank))
                landed.append((ins, bufs))
            elif isinstance(ins, SendGrad):
                meta = comm.received[self._received_key(b, *slot)]
                leaves = meta.flatten(b.inputs.pop(slot))
                grads = [leaves[i].grad if leaves[i].grad is not None else torch.zeros_like(leaves[i])
                         for i in meta.grad_positions]
                sends.append((grads, comm.prev_rank, GRAD_TAG))
            elif isinstance(ins, RecvGrad):
                bufs = comm.sent[self._sent_key(b, *slot)].empty_grads(self.device)
                recvs.append((bufs, comm.next_rank, GRAD_TAG))
                landed.append((ins, bufs))
        handles = comm.post(sends, recvs)
        t0 = time.perf_counter()
        for ins in overlapped:
            self._compute(ins, b)
        inside = time.perf_counter() - t0
        comm.wait(handles)
        for ins, bufs in landed:
            slot = (ins.chunk, ins.mb)
            if isinstance(ins, RecvActivation):
                meta = comm.received[self._received_key(b, *slot)]
                if b.train:
                    for t, m in zip(bufs, meta.tensors):
                        t.requires_grad_(m.requires_grad)
                b.inputs[slot] = meta.unflatten(bufs)
            else:
                b.grads[slot] = bufs
        return inside
