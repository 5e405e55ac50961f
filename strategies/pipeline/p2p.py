"""Point-to-point traffic between neighbouring stages.

What crosses a stage boundary is a tensor or a tuple of tensors. Its layout (count, shapes,
dtypes, which tensors require grad) travels once as a small int64 *header* before the first
micro-batch of a given input shape; both ends cache it under a key that both can compute without
talking (the micro-batch's input shapes and train/eval mode: every stage of a replica sees the
same batch). After that only the tensors travel, received into buffers allocated from the cached
layout. Gradients travel back only for the tensors that require grad, in the same order, so their
layout is the sender's own cached header.

One exchange posts all of its sends and receives with ``batch_isend_irecv`` and waits for all of
them before the executor moves on (``Exchange`` is the in-flight value: its handles and the
tensors that must stay alive until they complete). The headers an exchange needs are posted the
same way just before it (sizes, then contents), never as lone blocking calls: with virtual stages
the stages form a ring, and blocking header sends all round it would wait on each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from .. import instrument

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_HEADER_TAG = 7_000  # headers never share a tag with data (tags 0..n-1: position in the tuple)
#: gradients travel under tags GRAD_TAG + position: with two stages in a ring (interleaved 1F1B) the
#: previous and the next stage are the same rank, and one exchange may carry both kinds to it
GRAD_TAG = 1_000


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ActivationMeta:
    """The layout of one stage-boundary value: a tensor, or a tuple of tensors."""

    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @classmethod
    def of(cls, value: Any) -> "ActivationMeta":
        is_tuple = isinstance(value, (tuple, list))
        items = tuple(value) if is_tuple else (value,)
        for i, t in enumerate(items):
            if not torch.is_tensor(t):
                raise TypeError(f"pipeline: a stage returned {type(t).__name__} at position {i}; values "
                                "passed between stages must be a tensor or a tuple of tensors")
            if t.dtype not in _DTYPES:
                raise TypeError(f"pipeline: dtype {t.dtype} at position {i} cannot cross a stage boundary")
        return cls(tuple(TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad)) for t in items), is_tuple)

    def flatten(self, value: Any) -> list[torch.Tensor]:
        return list(value) if self.is_tuple else [value]

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> Any:
        return tuple(tensors) if self.is_tuple else tensors[0]

    @property
    def grad_positions(self) -> list[int]:
        """Positions of the tensors whose gradient travels back."""
        return [i for i, t in enumerate(self.tensors) if t.requires_grad]

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(t.shape, dtype=t.dtype, device=device) for t in self.tensors]

    def empty_grads(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(self.tensors[i].shape, dtype=self.tensors[i].dtype, device=device)
                for i in self.grad_positions]

    def encode(self) -> torch.Tensor:
        out = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            out += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
        return torch.tensor(out, dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor) -> "ActivationMeta":
        v = [int(x) for x in header.tolist()]
        is_tuple, n, pos, tensors = bool(v[0]), v[1], 2, []
        for _ in range(n):
            dtype, rg, ndim = _DTYPES[v[pos]], bool(v[pos + 1]), v[pos + 2]
            tensors.append(TensorMeta(tuple(v[pos + 3:pos + 3 + ndim]), dtype, rg))
            pos += 3 + ndim
        return cls(tuple(tensors), is_tuple)


class Exchange(NamedTuple):
    """Posted sends and receives: wait on ``works``; ``keep`` holds the send buffers alive."""

    works: list
    keep: list


class PipeComm:
    """This stage's links to its neighbours (global ranks; ``None`` at the ends)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        self.sent: dict[Hashable, ActivationMeta] = {}  # layouts this stage sent forward
        self.received: dict[Hashable, ActivationMeta] = {}  # layouts it received

    # ---- headers (at most once per key and direction, batched like the data)
    def exchange_headers(self, sends: list[tuple[Hashable, ActivationMeta]], recvs: list[Hashable]) -> None:
        """Send the layouts of ``sends`` not sent before to the next stage and receive those of
        ``recvs`` not known yet from the previous one, all posted together (both ends of a
        boundary meet its first message in the same exchange, so they agree on which is new)."""
        out = [(key, meta) for key, meta in sends if not self._known_sent(key, meta)]
        keys = [key for key in recvs if key not in self.received]
        if not out and not keys:
            return
        encoded = [meta.encode().to(self.device) for _, meta in out]
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in keys]
        self.wait(self.post([([torch.tensor([e.numel()], dtype=torch.int64, device=self.device)], self.next_rank,
                               _HEADER_TAG) for e in encoded], [([t], self.prev_rank, _HEADER_TAG) for t in sizes]))
        headers = [torch.zeros(int(t.item()), dtype=torch.int64, device=self.device) for t in sizes]
        self.wait(self.post([([e], self.next_rank, _HEADER_TAG + 1) for e in encoded],
                            [([h], self.prev_rank, _HEADER_TAG + 1) for h in headers]))
        self.sent.update(out)
        self.received.update((key, ActivationMeta.decode(h.cpu())) for key, h in zip(keys, headers))

    def _known_sent(self, key: Hashable, meta: ActivationMeta) -> bool:
        known = self.sent.get(key)
        if known is not None and known != meta:
            raise RuntimeError(
                f"pipeline: the activation sent to rank {self.next_rank} changed layout for the same "
                f"micro-batch input shapes ({known} -> {meta}); stage outputs must depend only on "
                "the input shapes")
        return known is not None

    # ---- data
    def post(self, sends: list[tuple], recvs: list[tuple]) -> Exchange:
        """Post ``(tensors, peer[, tag])`` sends and receives as one batch; tensor ``i`` of a
        message uses tag ``tag + i`` (``tag`` 0 unless given)."""
        ops, keep = [], []
        for tensors, peer, *tag in sends:
            for i, t in enumerate(tensors):
                t = t.detach().contiguous()
                keep.append(t)
                ops.append(dist.P2POp(dist.isend, t, peer, tag=(tag[0] if tag else 0) + i))
        for tensors, peer, *tag in recvs:
            for i, t in enumerate(tensors):
                ops.append(dist.P2POp(dist.irecv, t, peer, tag=(tag[0] if tag else 0) + i))
        works = dist.batch_isend_irecv(ops) if ops else []
        instrument.point_to_point(sends, recvs)
        return Exchange(works, keep)

    @staticmethod
    def wait(exchange: Exchange) -> None:
        started = instrument.wait_begin()
        for w in exchange.works:
            w.wait()
        instrument.wait_end(started)
