"""ZeRO-3 gradient partitions on NVMe (``grad_device="nvme"``): no whole-model gradient in RAM.

Without it a rank keeps its reduced gradient partition in RAM from backward to the step: the
reduce dtype's bytes for every parameter (2 B/param in bf16), the largest thing NVMe offload
still holds per parameter. With it, each unit's gradient lives in RAM only while it is reduced:

* backward: when a unit's reduction lands (``Unit.reduce_grads``), the unit hands its averaged
  partition to :meth:`SwappedGrads.accumulate` instead of adding it to a RAM buffer; each
  sub-group's piece is copied into one of a few aligned staging buffers and written (O_DIRECT,
  asynchronously) into the gradient region at the end of that sub-group's swap file (see
  ``swapper.py``). A sub-group whose gradient was zeroed since its last write is written without
  reading (the piece copied in: what zeros plus it give); a later micro-batch reads it back,
  adds, and writes again (the same ``add_`` into the same dtype as in RAM, so the numbers are
  the same bit for bit);
* the step: the sub-group's one read brings its gradient in with its Adam state
  (:meth:`view`), and its write-back leaves the gradient region alone;
* zeroing (``zero``) only marks the sub-groups: the step reads a marked one as zeros, and the
  next backward writes it without reading;
* value clipping (``clamp``) is applied where the gradient is next read (the step, the norm, or
  the read-back of a later micro-batch), and the clip norm (``read_ranges``) streams the gradient
  regions through the staging buffers into one fp32 tensor per parameter, the same per-parameter
  norms the RAM path computes (``zero/comm/grad_norm.py``).

The stage's gradient partitions become meta tensors (their shapes, no memory): what asks for the
values gets them through these calls, and anything else fails loudly instead of reading stale
memory.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .aio import AsyncFileIO, Completed, IOHandle, aligned_empty
from .plan import SubGroup, run_pipelined
from .swapper import SwappedStates


class SwappedGrads:
    """Each unit's reduced gradient in the gradient regions of the sub-group swap files.
    ``slots[i]``: ``(unit, start)``, slot i is the unit's partition from ``start`` on;
    ``buffer_count`` staging buffers of the largest sub-group's gradient region."""

    def __init__(self, states: SwappedStates, subgroups: Sequence[SubGroup], slots: Sequence[tuple[Any, int]],
                 io: AsyncFileIO, buffer_count: int = 2) -> None:
        if states.grad_dtype is None:
            raise ValueError("SwappedGrads needs swap files with a gradient region (grad_dtype)")
        self.states, self.subgroups, self.io = states, list(subgroups), io
        self.dtype = states.grad_dtype
        #: per unit index: (sub-group, offset in the unit's partition, elements) of each piece
        self.pieces: dict[int, list[tuple[int, int, int]]] = {}
        for sg in self.subgroups:
            unit, start = slots[sg.slot]
            self.pieces.setdefault(unit.index, []).append((sg.index, start + sg.lo, sg.numel))
        n = len(self.subgroups)
        self.written = [False] * n  # the file holds the gradient accumulated since the last zero
        self.bound: list[float | None] = [None] * n  # a value clip not yet applied to the file's values
        largest = max((states.grad_region(k)[1] for k in range(n)), default=1)
        self.buffers = [aligned_empty(largest) for _ in range(buffer_count)]
        self._writes: list[tuple[int, IOHandle] | None] = [None] * buffer_count
        self._next = 0
        self.bytes_written = 0  # by backward's gradient writes (the step's reads are the swapper's)

    # ------------------------------------------------------------------ backward
    def accumulate(self, unit: Any, reduced: torch.Tensor) -> None:
        """Add ``reduced`` (this rank's averaged partition of ``unit``'s gradient) to what the
        files hold, sub-group by sub-group; the writes stay in flight."""
        for k, offset, n in self.pieces.get(unit.index, ()):
            b = self._next
            self._next = (b + 1) % len(self.buffers)
            self._wait_buffer(b)
            self._wait_subgroup(k)  # its previous write must land before its region is read or rewritten
            view = self._view(k, b)
            if self.written[k]:
                self._read(k, b).wait()
                self._apply_bound(k, view)
                view.add_(reduced[offset:offset + n])
            else:  # a zeroed RAM partition plus the piece: the piece, rounded to the file's dtype
                view.copy_(reduced[offset:offset + n])
            start, size = self.states.grad_region(k)
            self._writes[b] = (k, self.io.write(self.states.fds[k], self.buffers[b][:size], start,
                                                label=f"write grad sg{k}", on_error=self._on_error(k, "writing")))
            self.bytes_written += size
            self.written[k] = True

    def flush(self) -> None:
        """Wait for every gradient write in flight (before anything reads the files)."""
        for b in range(len(self.buffers)):
            self._wait_buffer(b)

    # ------------------------------------------------------------------ the step
    def view(self, k: int, b: int) -> torch.Tensor:
        """Sub-group k's gradient in the step's staging buffer b, once ``states.read(k, b)`` has
        landed: zeros if zeroed since its last write, the pending value clip applied."""
        g = self.states.grad_view(k, b)
        if not self.written[k]:
            g.zero_()
        else:
            self._apply_bound(k, g, keep=True)
        return g

    def zero(self, slots: Sequence[int] | None = None) -> None:
        """Zero the gradients of master slots ``slots`` (all when None): no I/O."""
        wanted = None if slots is None else set(slots)
        for sg in self.subgroups:
            if wanted is None or sg.slot in wanted:
                self.written[sg.index] = False
                self.bound[sg.index] = None

    def clamp(self, slots: Sequence[int], bound: float) -> None:
        """Clamp the gradients of ``slots`` to ``[-bound, bound]`` where they are next read."""
        wanted = set(slots)
        for sg in self.subgroups:
            k = sg.index
            if sg.slot in wanted and self.written[k]:
                self.bound[k] = bound if self.bound[k] is None else min(bound, self.bound[k])

    def read_ranges(self, ranges: Sequence[tuple[int, int, int]], visit: Callable[[int, torch.Tensor], None]) -> None:
        """Each range ``(slot, first element in the slot, elements)`` in fp32 (pending value clips
        applied, never-written sub-groups zero), given to ``visit(i, tensor)`` once complete: one
        read of every sub-group a range touches, a range's tensor kept only until it is complete
        (per-parameter gradient norms in torch's order, ``zero/comm/grad_norm.py``)."""
        self.flush()
        need: dict[int, list[int]] = {}
        left = []
        for i, (slot, off, n) in enumerate(ranges):
            hits = [sg.index for sg in self.subgroups if sg.slot == slot and sg.lo < off + n and off < sg.hi]
            for k in hits:
                need.setdefault(k, []).append(i)
            left.append(len(hits))
            if not hits:
                visit(i, torch.zeros(n, dtype=torch.float32))
        out: dict[int, torch.Tensor] = {}

        def fill(k: int, g: torch.Tensor | None) -> None:
            sg = self.subgroups[k]
            for i in need[k]:
                _, off, n = ranges[i]
                t = out.setdefault(i, torch.zeros(n, dtype=torch.float32))
                lo, hi = max(off, sg.lo), min(off + n, sg.hi)
                if g is not None:
                    t[lo - off:hi - off].copy_(g[lo - sg.lo:hi - sg.lo])
                left[i] -= 1
                if not left[i]:
                    visit(i, out.pop(i))

        for k in sorted(need):
            if not self.written[k]:
                fill(k, None)
        todo = [k for k in sorted(need) if self.written[k]]

        def add(j: int, b: int) -> None:
            g = self._view(todo[j], b)
            self._apply_bound(todo[j], g, keep=True)
            fill(todo[j], g)

        run_pipelined(len(todo), len(self.buffers), lambda j, b: self._read(todo[j], b), add,
                      lambda j, b: Completed())

    # ------------------------------------------------------------------ pieces
    def _view(self, k: int, b: int) -> torch.Tensor:
        return self.buffers[b][:self.subgroups[k].numel * self.dtype.itemsize].view(self.dtype)

    def _read(self, k: int, b: int) -> IOHandle:
        start, size = self.states.grad_region(k)
        return self.io.read(self.states.fds[k], self.buffers[b][:size], start, label=f"read grad sg{k}",
                            on_error=self._on_error(k, "reading"))

    def _apply_bound(self, k: int, g: torch.Tensor, keep: bool = False) -> None:
        """The pending value clip of sub-group k on ``g``; ``keep``: the file still holds the
        unclipped values (only ``accumulate`` writes the clipped sum back)."""
        if self.bound[k] is not None:
            g.clamp_(-self.bound[k], self.bound[k])
            if not keep:
                self.bound[k] = None

    def _wait_buffer(self, b: int) -> None:
        if self._writes[b] is not None:
            _, handle = self._writes[b]
            self._writes[b] = None
            handle.wait()

    def _wait_subgroup(self, k: int) -> None:
        for b, w in enumerate(self._writes):
            if w is not None and w[0] == k:
                self._wait_buffer(b)

    def _on_error(self, k: int, action: str):
        """An error naming the file and ``nvme_path`` (``SwappedStates``' messages)."""
        return lambda exc: self.states._error(exc, f"{action} the gradient region of", self.states._path(k))

    def staging(self) -> list[torch.Tensor]:
        return list(self.buffers)

    def close(self) -> None:
        self.flush()
        self.buffers = []
