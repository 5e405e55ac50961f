"""Sub-groups and the order in which their state is fetched, stepped and written back: pure logic,
no tensors or files, unit-tested on its own.

The optimizer steps *slots*: fp32 master tensors, each belonging to one optimizer param group
(ZeRO-2: one slot per group, this rank's partition of it; ZeRO-3: one slot per run of a unit's
partition inside one group). A *sub-group* is at most ``sub_group_size`` consecutive elements of one
slot. The offloaded step walks the sub-groups in order (slot 0's first). For each
one the optimizer state must be *read* into a staging buffer (a no-op when it lives in RAM), the
kernel *steps* it, and it is *written* back. :func:`run_pipelined` overlaps these with
``buffer_count`` staging buffers:

* reading sub-group k+1 is in flight while sub-group k steps (double buffering with
  ``buffer_count == 2``; with 4 or more buffers, ``buffer_count - 2`` reads run ahead);
* a buffer is read into again only after the write-back of its previous sub-group has finished;
  with 3 or more buffers that write-back has a whole step to finish in;
* all write-backs have finished when it returns.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence


@dataclass(frozen=True)
class SubGroup:
    index: int  # position in the step order
    slot: int  # which master tensor
    lo: int  # first element in the slot
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def plan_subgroups(slot_numels: Sequence[int], sub_group_size: int) -> list[SubGroup]:
    """Cut each slot into ranges of at most ``sub_group_size`` elements (empty slots give no
    sub-group)."""
    if sub_group_size < 1:
        raise ValueError(f"sub_group_size={sub_group_size} must be >= 1")
    out: list[SubGroup] = []
    for g, n in enumerate(slot_numels):
        if n < 0:
            raise ValueError(f"slot_numels[{g}]={n} must be >= 0")
        for lo in range(0, n, sub_group_size):
            out.append(SubGroup(len(out), g, lo, min(lo + sub_group_size, n)))
    return out


class Waitable(Protocol):
    def wait(self) -> object: ...


def run_pipelined(n: int, buffer_count: int, read: Callable[[int, int], Waitable],
                  step: Callable[[int, int], None], write: Callable[[int, int], Waitable],
                  trace: list | None = None) -> None:
    """Run ``read(k, b)``, ``step(k, b)``, ``write(k, b)`` for k in ``range(n)``, sub-group k using
    buffer ``b = k % buffer_count``. ``read`` and ``write`` start I/O and return a handle; this is
    the only place that waits on them. ``trace`` (optional) receives ``(event, k)`` tuples in the
    order things happen: ``read``/``write`` when issued, ``read_done``/``write_done`` when waited,
    ``step`` before stepping."""
    if buffer_count < 1:
        raise ValueError(f"buffer_count={buffer_count} must be >= 1")
    log = trace.append if trace is not None else (lambda event: None)
    reads: dict[int, Waitable] = {}
    writes: list[tuple[int, Waitable] | None] = [None] * buffer_count

    def wait_write(b: int) -> None:
        if writes[b] is not None:
            k_old, handle = writes[b]
            handle.wait()
            log(("write_done", k_old))
            writes[b] = None

    def issue_read(k: int) -> None:
        b = k % buffer_count
        wait_write(b)  # the buffer's previous sub-group must be on disk before it is reused
        log(("read", k))
        reads[k] = read(k, b)

    # reads run `ahead` sub-groups in front; with 3+ buffers one more buffer stays free, so the
    # write-back of sub-group k-1 has the whole step of k to finish before its buffer is reused
    ahead = 1 if buffer_count <= 3 else buffer_count - 2
    finished = False
    try:
        for k in range(min(ahead, n)):
            issue_read(k)
        for k in range(n):
            b = k % buffer_count
            reads.pop(k).wait()
            log(("read_done", k))
            if k + ahead < n and (k + ahead) % buffer_count != b:
                issue_read(k + ahead)  # in flight while sub-group k steps
            log(("step", k))
            step(k, b)
            log(("write", k))
            writes[b] = (k, write(k, b))
            if k + ahead < n and (k + ahead) % buffer_count == b:
                issue_read(k + ahead)  # a single buffer: nothing to overlap with
        for b in range(buffer_count):
            wait_write(b)
        finished = True
    finally:
        if not finished:  # never leave I/O running into buffers the caller may reuse or free
            for handle in [*reads.values(), *(w[1] for w in writes if w is not None)]:
                with contextlib.suppress(Exception):
                    handle.wait()
