"""Pipeline schedules as pure instruction lists, one list per stage.

A stage executes its list top to bottom. Compute instructions (``LoadMicroBatch``, ``Forward``,
``Backward``) run locally; communication instructions (``Send*``/``Recv*``) that follow each other
form one *exchange*, posted together with ``batch_isend_irecv`` and waited on together. The lists
are written so that they progress even when every exchange blocks until each of its operations
is matched by the peer (the strictest semantics, NCCL's), which the unit tests check by
simulating all stages at once.

Data flow for micro-batch ``mb`` on stage ``s`` of ``p``::

    s == 0: LoadMicroBatch(mb)    (inputs)     s == p-1: LoadMicroBatch(mb)   (targets)
    s > 0:  RecvActivation(mb)  -> Forward(mb) -> SendActivation(mb)  if s < p-1
    s < p-1: RecvGrad(mb)       -> Backward(mb) -> SendGrad(mb)       if s > 0

GPipe runs all forwards, then all backwards: a stage holds the activations of all ``m``
micro-batches. 1F1B (PipeDream-Flush, as in Megatron-LM) runs ``p - s - 1`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards: stage ``s`` holds at
most ``min(p - s, m)`` micro-batches. Both have the same bubble, ``(p - 1) / (m + p - 1)`` of a
step; 1F1B is the default because of the memory bound.

Every stage after the first starts with ``RecvActivation(0)`` and nothing else, so it waits there
from the start; the executor may therefore precede a stage's first send and receive of activations
with a blocking shape header without changing the analysis.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class Instruction:
    mb: int

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mb})"


class LoadMicroBatch(Instruction):
    """Stage 0 takes the micro-batch's inputs; the last stage takes its targets."""


class Forward(Instruction):
    """Run this stage's layers (and, on the last stage, the loss) on the micro-batch."""


class Backward(Instruction):
    """Back-propagate the micro-batch through this stage, given the gradient of its outputs."""


class SendActivation(Instruction):
    """Send the stage's outputs to the next stage."""


class RecvActivation(Instruction):
    """Receive the previous stage's outputs as this stage's inputs."""


class SendGrad(Instruction):
    """Send the gradient of this stage's inputs back to the previous stage."""


class RecvGrad(Instruction):
    """Receive the gradient of this stage's outputs from the next stage."""


COMM = (SendActivation, RecvActivation, SendGrad, RecvGrad)
Step = Union[Instruction, list]  # a compute instruction or one exchange (a list of comm instructions)


def is_comm(ins: Instruction) -> bool:
    return isinstance(ins, COMM)


def _check(stage: int, num_stages: int, micro_batches: int) -> None:
    if num_stages < 1 or micro_batches < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"schedule: need 0 <= stage < num_stages and micro_batches >= 1, got "
                         f"stage={stage}, num_stages={num_stages}, micro_batches={micro_batches}")


class _Builder:
    """Emits one stage's instructions, dropping the sends/receives that have no peer (and
    checking the stage's arguments first, for every schedule)."""

    def __init__(self, stage: int, num_stages: int, micro_batches: int) -> None:
        _check(stage, num_stages, micro_batches)
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.out: list[Instruction] = []

    def recv_forward(self, mb: int) -> None:
        if not self.first:
            self.out.append(RecvActivation(mb))

    def forward(self, mb: int) -> None:
        if self.first or self.last:
            self.out.append(LoadMicroBatch(mb))
        self.out.append(Forward(mb))

    def send_forward(self, mb: int) -> None:
        if not self.last:
            self.out.append(SendActivation(mb))

    def recv_backward(self, mb: int) -> None:
        if not self.last:
            self.out.append(RecvGrad(mb))

    def backward(self, mb: int) -> None:
        self.out.append(Backward(mb))

    def send_backward(self, mb: int) -> None:
        if not self.first:
            self.out.append(SendGrad(mb))

    def forward_pass(self, mb: int) -> None:
        """Receive, forward and send one micro-batch: the whole forward of a GPipe or
        inference step, and 1F1B's warm-up."""
        self.recv_forward(mb)
        self.forward(mb)
        self.send_forward(mb)

    def backward_pass(self, mb: int) -> None:
        """Receive the gradient, backward and send it on: GPipe's backward, 1F1B's cool-down."""
        self.recv_backward(mb)
        self.backward(mb)
        self.send_backward(mb)


def gpipe(stage: int, num_stages: int, micro_batches: int) -> list[Instruction]:
    """All forwards, then all backwards (in the same order)."""
    b = _Builder(stage, num_stages, micro_batches)
    for mb in range(micro_batches):
        b.forward_pass(mb)
    for mb in range(micro_batches):
        b.backward_pass(mb)
    return b.out


def one_f_one_b(stage: int, num_stages: int, micro_batches: int) -> list[Instruction]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    In the steady phase a stage sends its activation together with receiving the gradient it
    needs next, and sends a gradient together with receiving the next activation: pairing them
    in one exchange is what keeps neighbours from each waiting on the other.
    """
    b = _Builder(stage, num_stages, micro_batches)
    warmup = min(num_stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    for mb in range(warmup):
        b.forward_pass(mb)
    if steady:
        b.recv_forward(warmup)
    for i in range(steady):
        fwd, bwd = warmup + i, i
        b.forward(fwd)
        b.send_forward(fwd)
        b.backward_pass(bwd)  # its receive is in the same exchange as the send above
        if i + 1 < steady:
            b.recv_forward(fwd + 1)  # same exchange as the send above
    for bwd in range(steady, micro_batches):
        b.backward_pass(bwd)
    return b.out


def inference(stage: int, num_stages: int, micro_batches: int) -> list[Instruction]:
    """Forward only (validation): receive, forward, send, for each micro-batch."""
    b = _Builder(stage, num_stages, micro_batches)
    for mb in range(micro_batches):
        b.forward_pass(mb)
    return b.out


SCHEDULES: dict[str, Callable[[int, int, int], list[Instruction]]] = {
    "1f1b": one_f_one_b, "gpipe": gpipe}


def schedule_from_name(name: str) -> Callable[[int, int, int], list[Instruction]]:
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r}; valid choices: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def steps(instructions: list[Instruction]) -> list[Step]:
    """Group consecutive communication instructions into exchanges (lists); compute
    instructions stay single. The executor and the simulator both walk this."""
    out: list[Step] = []
    for ins in instructions:
        if is_comm(ins):
            if out and isinstance(out[-1], list):
                out[-1].append(ins)
            else:
                out.append([ins])
        else:
            out.append(ins)
    return out


def live_activation_peak(instructions: list[Instruction]) -> int:
    """How many micro-batches' activations a stage holds at most: a forward keeps its
    activations until that micro-batch's backward."""
    live = peak = 0
    for ins in instructions:
        if isinstance(ins, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(ins, Backward):
            live -= 1
    return peak


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of a flushed pipeline step with equal stage times: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)
