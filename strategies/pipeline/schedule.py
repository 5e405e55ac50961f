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

Zero-bubble H1 (``zero_bubble_h1``, ``"zb_h1"``) is 1F1B with each backward split: ``Backward``
computes only the gradients of the stage's inputs and ``WeightGrad`` the weights' later, inside
the exchanges where the stage would wait; a third of 1F1B's bubble, the same live activations.

Interleaved 1F1B (``interleaved_1f1b``, ``virtual_stages`` > 1) gives each stage several model
chunks; the instructions carry the chunk (``Instruction.chunk``) and the stages form a ring (the
last stage's chunk ``c`` feeds chunk ``c + 1`` of stage 0). Its bubble is ``(p - 1) / (v * m)`` of
the ideal step time (``bubble_ratio``), ``v`` times smaller. ``simulate.py`` runs any set of lists
together to prove them deadlock-free and measure bubble and live activations.

Every stage after the first starts with ``RecvActivation(0)`` and nothing else, so it waits there
from the start. The executor precedes the first exchange of each stage boundary with its shape
header, posted as an exchange of its own between the same two ends (``PipeComm.exchange_headers``),
which leaves the analysis unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class Instruction:
    mb: int
    #: the model chunk the instruction runs on or sends for (interleaved schedules: chunk ``c`` of
    #: stage ``s`` is virtual stage ``c * num_stages + s``); 0 everywhere else
    chunk: int = 0

    def __repr__(self) -> str:
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"{type(self).__name__}({self.mb}{chunk})"


class LoadMicroBatch(Instruction):
    """Stage 0 takes the micro-batch's inputs; the last stage takes its targets."""


class Forward(Instruction):
    """Run this stage's layers (and, on the last stage, the loss) on the micro-batch."""


class Backward(Instruction):
    """Back-propagate the micro-batch through this stage, given the gradient of its outputs."""


class WeightGrad(Instruction):
    """The weight gradients of a micro-batch whose ``Backward`` computed only the gradients of the
    stage's inputs (zero-bubble schedules; ``weight_grad.py``). Placed right after communication
    instructions, it runs while that exchange is in flight (``steps``)."""


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


def _check(stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1 or micro_batches < 1 or virtual_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"schedule: need 0 <= stage < num_stages, micro_batches >= 1 and virtual_stages >= 1, "
                         f"got stage={stage}, num_stages={num_stages}, micro_batches={micro_batches}, "
                         f"virtual_stages={virtual_stages}")


class _Builder:
    """Emits one stage's instructions, dropping the sends/receives that have no peer (and
    checking the stage's arguments first, for every schedule). With virtual stages the ends are
    chunk 0 of stage 0 and the last chunk of the last stage; every other chunk has both peers."""

    def __init__(self, stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
        _check(stage, num_stages, micro_batches, virtual_stages)
        self.stage, self.num_stages, self.virtual_stages = stage, num_stages, virtual_stages
        self.out: list[Instruction] = []

    def is_first(self, chunk: int) -> bool:
        return self.stage == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage == self.num_stages - 1 and chunk == self.virtual_stages - 1

    def recv_forward(self, mb: int, chunk: int = 0) -> None:
        if not self.is_first(chunk):
            self.out.append(RecvActivation(mb, chunk))

    def forward(self, mb: int, chunk: int = 0) -> None:
        if self.is_first(chunk) or self.is_last(chunk):
            self.out.append(LoadMicroBatch(mb, chunk))
        self.out.append(Forward(mb, chunk))

    def send_forward(self, mb: int, chunk: int = 0) -> None:
        if not self.is_last(chunk):
            self.out.append(SendActivation(mb, chunk))

    def recv_backward(self, mb: int, chunk: int = 0) -> None:
        if not self.is_last(chunk):
            self.out.append(RecvGrad(mb, chunk))

    def backward(self, mb: int, chunk: int = 0) -> None:
        self.out.append(Backward(mb, chunk))

    def send_backward(self, mb: int, chunk: int = 0) -> None:
        if not self.is_first(chunk):
            self.out.append(SendGrad(mb, chunk))

    def forward_pass(self, mb: int, chunk: int = 0) -> None:
        """Receive, forward and send one micro-batch: the whole forward of a GPipe or
        inference step, and 1F1B's warm-up."""
        self.recv_forward(mb, chunk)
        self.forward(mb, chunk)
        self.send_forward(mb, chunk)

    def backward_pass(self, mb: int, chunk: int = 0) -> None:
        """Receive the gradient, backward and send it on: GPipe's backward, 1F1B's cool-down."""
        self.recv_backward(mb, chunk)
        self.backward(mb, chunk)
        self.send_backward(mb, chunk)


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
    _one_f_one_b_into(b, micro_batches, lambda bwd: None)
    return b.out


def _one_f_one_b_into(b: _Builder, micro_batches: int, after_backward: Callable[[int], None]) -> None:
    """1F1B's instructions into ``b``; ``after_backward(mb)`` adds what follows micro-batch
    ``mb``'s backward and the send of its gradient (in the exchange with the next receive)."""
    warmup = min(b.num_stages - b.stage - 1, micro_batches)
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
        after_backward(bwd)
        if i + 1 < steady:
            b.recv_forward(fwd + 1)  # same exchange as the send above
    for bwd in range(steady, micro_batches):
        b.backward_pass(bwd)
        after_backward(bwd)


def zero_bubble_h1(stage: int, num_stages: int, micro_batches: int) -> list[Instruction]:
    """1F1B with each backward split in two (ZB-H1 of Qi et al., "Zero Bubble Pipeline
    Parallelism", 2023): ``Backward`` computes only the gradients of the stage's inputs, which the
    previous stage waits for, and ``WeightGrad`` the weights' gradients, which nobody waits for.

    Stage ``s`` runs each micro-batch's ``WeightGrad`` ``s`` backwards late, inside the exchange
    after a later backward (while that exchange's receive is in flight), and its last ``s`` after
    its last backward: the stages near the end of the pipeline finish their input gradients first
    and would idle while the gradients travel back to stage 0, so they spend that time on weight
    gradients. The order of forwards and backwards, the exchanges, and the peak of live
    activations (``min(p - s, m)``) are 1F1B's; the bubble falls from ``(p - 1) (F + B + W)`` to
    about ``(p - 1) (F + B - W)`` (``simulate``). A micro-batch's weight-gradient inputs (each
    linear layer's input and output gradient) are held until its ``WeightGrad``: ``s`` more
    micro-batches of them on stage ``s``."""
    b = _Builder(stage, num_stages, micro_batches)
    done = 0

    def weight_grads(up_to: int) -> None:
        nonlocal done
        while done < up_to:
            b.out.append(WeightGrad(done))
            done += 1

    _one_f_one_b_into(b, micro_batches, lambda bwd: weight_grads(bwd + 1 - stage))
    weight_grads(micro_batches)
    return b.out


def interleaved_slots(stage: int, num_stages: int, micro_batches: int, virtual_stages: int,
                      train: bool = True) -> list[list[tuple[str, int, int]]]:
    """The compute order of interleaved 1F1B on one stage, as *slots* of ``("F" | "B", chunk,
    mb)``: a warm-up slot is one forward, a steady slot one forward then one backward, a
    cool-down slot one backward.

    Forwards go through the micro-batches in groups of ``num_stages``: chunk 0 of the group, then
    chunk 1, ..., then the next group (a micro-batch comes back to this stage for its next chunk
    after ``num_stages`` forwards, just when the ring returns it). Backwards follow the same order
    with the chunks reversed. Warm-up runs ``2 * (num_stages - stage - 1) + (virtual_stages - 1) *
    num_stages`` forwards (Megatron-LM's count: the ring's depth ahead of this stage, twice for
    the forward and the returning gradient), capped at every forward of the step. Without
    ``train`` every slot is one forward.
    """
    _check(stage, num_stages, micro_batches, virtual_stages)
    p, v = num_stages, virtual_stages
    total = micro_batches * v

    def fwd(k: int) -> tuple[str, int, int]:
        group, within = divmod(k, p * v)
        return "F", within // p, group * p + within % p

    def bwd(k: int) -> tuple[str, int, int]:
        _, chunk, mb = fwd(k)
        return "B", v - 1 - chunk, mb

    warmup = min(total, 2 * (p - stage - 1) + (v - 1) * p) if train else total
    return ([[fwd(k)] for k in range(warmup)] + [[fwd(warmup + i), bwd(i)] for i in range(total - warmup)]
            + [[bwd(k)] for k in range(total - warmup, total) if train])


def interleaved_1f1b(stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1,
                     train: bool = True) -> list[Instruction]:
    """1F1B over ``virtual_stages`` model chunks per stage (the interleaved schedule of
    Megatron-LM): chunk ``c`` of stage ``s`` is stage ``c * num_stages + s`` of a pipeline
    ``num_stages * virtual_stages`` deep whose activations go round the ring of stages
    ``virtual_stages`` times. The bubble shrinks to ``(p - 1) / (v * m)`` of the ideal time, for
    more messages and more live (smaller) activations.

    Communication is one exchange between slots (``interleaved_slots``): the sends of what the
    slot computed together with the receives the next slot needs. Every stage sends to its
    previous stage (gradients) in the same exchange as it receives from its next one, so the
    ring never waits on itself (sending right after computing and receiving right before, as
    ``one_f_one_b`` does, deadlocks the ring: the simulator shows it). The stage count must divide
    ``micro_batches`` (``check_interleaved``); ``virtual_stages=1`` is ``one_f_one_b`` (and
    ``inference`` without ``train``: forwards only, for validation)."""
    check_interleaved(num_stages, micro_batches, virtual_stages)
    if virtual_stages == 1:
        return (one_f_one_b if train else inference)(stage, num_stages, micro_batches)
    b = _Builder(stage, num_stages, micro_batches, virtual_stages)
    slots = interleaved_slots(stage, num_stages, micro_batches, virtual_stages, train)
    _receive_for(b, slots[0])
    for i, slot in enumerate(slots):
        for kind, chunk, mb in slot:
            if kind == "F":
                b.forward(mb, chunk)
            else:
                b.backward(mb, chunk)
        for kind, chunk, mb in slot:
            (b.send_forward if kind == "F" else b.send_backward)(mb, chunk)
        if i + 1 < len(slots):
            _receive_for(b, slots[i + 1])
    return b.out


def _receive_for(b: _Builder, slot: list[tuple[str, int, int]]) -> None:
    for kind, chunk, mb in slot:
        (b.recv_forward if kind == "F" else b.recv_backward)(mb, chunk)


def check_interleaved(num_stages: int, micro_batches: int, virtual_stages: int) -> None:
    """What interleaving needs: micro-batches in whole groups of ``num_stages`` (the order above
    cycles through the chunks one group at a time) and more than one stage."""
    if virtual_stages == 1:
        return
    if num_stages < 2:
        raise ValueError(f"pipeline: virtual_stages={virtual_stages} with stages={num_stages}: interleaving "
                         "needs at least 2 stages; valid: virtual_stages=1, or more stages")
    if micro_batches % num_stages:
        raise ValueError(f"pipeline: micro_batches={micro_batches} with virtual_stages={virtual_stages}: the "
                         f"interleaved schedule needs a multiple of stages={num_stages}; valid: micro_batches "
                         f"in {[num_stages * k for k in range(1, 4)]}..., or virtual_stages=1")


def inference(stage: int, num_stages: int, micro_batches: int) -> list[Instruction]:
    """Forward only (validation): receive, forward, send, for each micro-batch."""
    b = _Builder(stage, num_stages, micro_batches)
    for mb in range(micro_batches):
        b.forward_pass(mb)
    return b.out


SCHEDULES: dict[str, Callable[[int, int, int], list[Instruction]]] = {
    "1f1b": one_f_one_b, "gpipe": gpipe, "zb_h1": zero_bubble_h1}


def schedule_from_name(name: str) -> Callable[[int, int, int], list[Instruction]]:
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r}; valid choices: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def steps(instructions: list[Instruction]) -> list[Step]:
    """Group consecutive communication instructions into exchanges (lists); compute
    instructions stay single. A ``WeightGrad`` that follows a communication instruction joins its
    exchange: it is computed after the exchange's operations are posted and before they are
    waited on, so the schedule's deadlock analysis is that of the exchange without it. The
    executor and the simulator both walk this."""
    out: list[Step] = []
    for ins in instructions:
        if is_comm(ins) or (isinstance(ins, WeightGrad) and out and isinstance(out[-1], list)):
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


def bubble_fraction(num_stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a flushed pipeline step with equal stage times and free communication:
    (p - 1) / (v * m + p - 1) (v = 1: 1F1B and GPipe)."""
    return (num_stages - 1) / (virtual_stages * micro_batches + num_stages - 1)


def bubble_ratio(num_stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The same bubble as a share of the ideal (bubble-free) step time: (p - 1) / (v * m)."""
    return (num_stages - 1) / (virtual_stages * micro_batches)


def peak_live_formula(stage: int, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> int:
    """Most chunk activations stage ``stage`` holds under (interleaved) 1F1B: its warm-up
    forwards plus the first steady one, at most every forward of the step. A chunk is ``1 /
    virtual_stages`` of the stage, so divide by ``virtual_stages`` for stage-sized micro-batches."""
    p, v, m = num_stages, virtual_stages, micro_batches
    if v == 1:
        return min(m, p - stage)
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
