"""Where each sub-group's Adam state lives between steps: RAM (:class:`RamStates`) or files on an
NVMe drive (:class:`SwappedStates`). Both answer the same three calls the pipelined step makes:
``read(k, b)`` (start bringing sub-group k's state into staging buffer b), ``views(k, b)`` (its
fp32 master, exp_avg and exp_avg_sq as tensors) and ``write(k, b)`` (start putting it back).

Swap layout: one scratch file per sub-group under ``<nvme_path>/<unique dir>/``, holding the
swapped fp32 tensors back to back, each padded to :data:`~.aio.ALIGN` bytes::

    sg00003.swp:  [ master (n) | pad ][ exp_avg (n) | pad ][ exp_avg_sq (n) | pad ]

so one read or write moves a sub-group, with every offset and length aligned for ``O_DIRECT``.
With ``state_dtype=torch.bfloat16`` (``optimizer_state_dtype="bf16"``) the two moments are bf16
(half the bytes; the kernel rounds them stochastically); the master is fp32 always, and
checkpoint snapshots are fp32 whatever the files hold.
The master is swapped only when nothing else needs it in RAM: when the working parameters *are*
the fp32 master (fp32 training) or the stage owns it (ZeRO-3 units), it is an *external* master,
stepped in place, and the files hold the two Adam moments only.
The staging buffers (``buffer_count`` of them, each the size of the largest sub-group's file) are
the only RAM the swapped state uses.

With ``grad_dtype`` (ZeRO-3's ``grad_device="nvme"``) each file ends with one more region, the
sub-group's reduced gradient (``[ ... ][ grad (n) | pad ]``): :class:`~.grad_swap.SwappedGrads`
writes it during backward, ``read`` brings it in with the state (``grad_view``), and ``write``
puts back the state regions only: the step never writes a gradient.

Swap files are scratch: they are removed at ``close()`` and never referenced by a checkpoint.
:meth:`SwappedStates.snapshot` streams them into one file per (tensor kind, slot) written
with :func:`~.aio.atomic_file` (temp + fsync + rename), and returns tensors *memory-mapped* from
those copies: a checkpoint then holds the real state without loading it all into RAM, and a later
snapshot replaces the files by rename, so tensors mapped from an earlier one keep their bytes.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Callable, Sequence

import torch

from .aio import ALIGN, AsyncFileIO, Completed, IOHandle, aligned_empty, atomic_file, offload_error, \
    open_swap_file, round_up, write_tensor_at
from ...ops.reference import round_to_bf16_stochastic, stochastic_rounding_key
from .plan import SubGroup, run_pipelined

KINDS = ("master", "exp_avg", "exp_avg_sq")


class RamStates:
    """State in RAM: the optimizer's own ``state`` dict, looked up at every step (so whoever loads
    it - our checkpoint code or the stage's - is seen at once); views are slices, I/O a no-op."""

    buffer_count = 1

    def __init__(self, subgroups: Sequence[SubGroup], masters: Sequence[torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> None:
        self.subgroups, self.masters, self.optimizer = list(subgroups), list(masters), optimizer

    def slot_state(self, slot: int) -> dict:
        m = self.masters[slot]
        st = self.optimizer.state[m]  # looked up each time: load_state_dict replaces the dict
        for kind in ("exp_avg", "exp_avg_sq"):
            if kind not in st:  # before the first step, or a checkpoint taken before it
                st[kind] = torch.zeros_like(m)
            elif not st[kind].is_contiguous():
                st[kind] = st[kind].contiguous()
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
        return st

    def views(self, k: int, b: int) -> tuple[torch.Tensor, ...]:
        sg = self.subgroups[k]
        st = self.slot_state(sg.slot)
        return (self.masters[sg.slot][sg.lo:sg.hi], st["exp_avg"][sg.lo:sg.hi], st["exp_avg_sq"][sg.lo:sg.hi])

    def read(self, k: int, b: int) -> IOHandle:
        return Completed("ram")

    def write(self, k: int, b: int) -> IOHandle:
        return Completed("ram")

    def staging(self) -> list[torch.Tensor]:
        return []

    def close(self) -> None:
        pass


class SwappedStates:
    """State in per-sub-group files, moved through ``buffer_count`` aligned staging buffers.
    ``external_master``: one RAM tensor per slot holding the master (not swapped), or None."""

    def __init__(self, nvme_path: str, subgroups: Sequence[SubGroup], buffer_count: int,
                 io: AsyncFileIO, direct: bool, pin: bool = False, rank: int = 0,
                 external_master: Sequence[torch.Tensor] | None = None,
                 state_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None) -> None:
        if buffer_count < 1:
            raise ValueError(f"buffer_count={buffer_count} must be >= 1")
        self.nvme_path, self.rank = nvme_path, rank
        try:
            os.makedirs(nvme_path, exist_ok=True)
            self.directory = tempfile.mkdtemp(prefix=f"zerotrain-offload-rank{rank}-", dir=nvme_path)
        except OSError as exc:
            raise self._error(exc, "creating a folder in", nvme_path) from exc
        self.subgroups, self.io, self.direct = list(subgroups), io, direct
        self.buffer_count = buffer_count
        self.external = list(external_master) if external_master is not None else None
        self.kinds = KINDS[1:] if self.external is not None else KINDS  # what the files hold
        self.state_dtype = state_dtype
        self.dtypes = [torch.float32 if kind == "master" else state_dtype for kind in self.kinds]
        self.grad_dtype = grad_dtype  # the gradient region's, after the state's (None: no region)
        #: per sub-group: (byte offset, dtype) of each kind in its file (the gradient last), and
        #: the file's size
        self.layout = [_file_layout(sg.numel, self.dtypes + ([grad_dtype] if grad_dtype else []))
                       for sg in self.subgroups]
        self.fds: list[int] = []
        try:
            for sg, (_, size) in zip(self.subgroups, self.layout):
                try:
                    self.fds.append(open_swap_file(self._path(sg.index), size, direct))
                except OSError as exc:
                    raise self._error(exc, "creating", self._path(sg.index)) from exc
        except BaseException:
            self.close()
            raise
        largest = max((size for _, size in self.layout), default=ALIGN)
        self.buffers = [aligned_empty(largest, pin=pin) for _ in range(buffer_count)]

    def _path(self, k: int) -> str:
        return os.path.join(self.directory, f"sg{k:05d}.swp")

    def _error(self, exc: OSError, action: str, path: str) -> OSError:
        """An OSError naming the file and the ``nvme_path`` setting (a full or read-only disk)."""
        return offload_error(exc, action, path, self.nvme_path)

    def _span(self, k: int, b: int) -> torch.Tensor:
        return self.buffers[b][:self.layout[k][1]]

    def _state_span(self, k: int, b: int) -> torch.Tensor:
        """The state regions of sub-group k in buffer b (the whole file when it has no gradient)."""
        regions, size = self.layout[k]
        return self.buffers[b][:regions[len(self.kinds)][0] if self.grad_dtype else size]

    def grad_region(self, k: int) -> tuple[int, int]:
        """(byte offset, padded bytes) of sub-group k's gradient region in its file."""
        regions, size = self.layout[k]
        return regions[-1][0], size - regions[-1][0]

    def grad_view(self, k: int, b: int) -> torch.Tensor:
        """Sub-group k's gradient as ``read(k, b)`` brought it into buffer b."""
        offset, _ = self.grad_region(k)
        n = self.subgroups[k].numel
        return self._span(k, b)[offset:offset + n * self.grad_dtype.itemsize].view(self.grad_dtype)

    def rounding_seed(self, k: int) -> int:
        """The stochastic-rounding seed of sub-group k's bf16 moments: fixed per (rank, sub-group),
        so a run is reproducible, and different between sub-groups (the kernel's noise hashes
        the element index within the slice it is given)."""
        return (self.rank * 0x632BE5AB + k * 0x9E3779B1 + 0x5EED) & 0xFFFFFFFF

    def views(self, k: int, b: int) -> tuple[torch.Tensor, ...]:
        """Sub-group k's (master, exp_avg, exp_avg_sq) in staging buffer b: fp32 master, the
        moments in ``state_dtype``."""
        sg = self.subgroups[k]
        n, span = sg.numel, self._span(k, b)
        swapped = [span[off:off + n * dt.itemsize].view(dt) for off, dt in self.layout[k][0][:len(self.kinds)]]
        if self.external is not None:
            return (self.external[sg.slot][sg.lo:sg.hi], *swapped)
        return tuple(swapped)

    def read(self, k: int, b: int) -> IOHandle:
        return self.io.read(self.fds[k], self._span(k, b), 0, label=f"read sg{k}",
                            on_error=lambda exc: self._error(exc, "reading", self._path(k)))

    def write(self, k: int, b: int) -> IOHandle:
        return self.io.write(self.fds[k], self._state_span(k, b), 0, label=f"write sg{k}",
                             on_error=lambda exc: self._error(exc, "writing", self._path(k)))

    def staging(self) -> list[torch.Tensor]:
        return list(self.buffers)

    def disk_bytes(self) -> int:
        return sum(size for _, size in self.layout)

    # ------------------------------------------------------------------ whole-state transfers
    def fill(self, values: dict[str, Sequence[torch.Tensor]]) -> None:
        """Write every sub-group from whole per-slot tensors ``values[kind][slot]`` (fp32; a
        missing kind is written as zeros; an external master is copied in place)."""
        def step(k: int, b: int) -> None:
            sg = self.subgroups[k]
            for kind, view in zip(KINDS, self.views(k, b)):
                src = values.get(kind)
                if src is not None:
                    self._store(view, src[sg.slot][sg.lo:sg.hi], k)
                elif kind != "master" or self.external is None:
                    view.zero_()

        run_pipelined(len(self.subgroups), self.buffer_count, lambda k, b: Completed(), step, self.write)

    def _store(self, view: torch.Tensor, value: torch.Tensor, k: int) -> None:
        """fp32 ``value`` into a staging view: bf16 moments are rounded stochastically, as the
        kernel stores them, so a loaded state is what a run that never stopped could hold (and a
        value that is already bf16 comes back exactly)."""
        if view.dtype == torch.bfloat16 and value.dtype != torch.bfloat16:
            view.copy_(round_to_bf16_stochastic(value.float(), stochastic_rounding_key(self.rounding_seed(k), 0)))
        else:
            view.copy_(value)

    def snapshot(self, slot_numels: Sequence[int], tag: str = "snapshot",
                 after: Callable[[int], None] | None = None) -> dict[str, list[torch.Tensor]]:
        """Copy the state (swapped and external) into one file per (kind, slot) atomically and
        return fp32 tensors memory-mapped from those files: ``{kind: [tensor per slot]}``.
        ``after(k)`` runs once sub-group k is copied (file-backed masters release pages there)."""
        directory = os.path.join(self.directory, tag)
        paths = {kind: [os.path.join(directory, f"{kind}_{i}.bin") for i in range(len(slot_numels))]
                 for kind in KINDS}
        doing = directory
        try:
            os.makedirs(directory, exist_ok=True)
            with contextlib.ExitStack() as stack:
                fds = {kind: [stack.enter_context(atomic_file(p)) for p in paths[kind]] for kind in KINDS}
                for kind in KINDS:
                    for fd, n, p in zip(fds[kind], slot_numels, paths[kind]):
                        doing = p
                        os.ftruncate(fd, 4 * n)

                def step(k: int, b: int) -> None:
                    nonlocal doing
                    sg = self.subgroups[k]
                    for kind, view in zip(KINDS, self.views(k, b)):
                        doing = paths[kind][sg.slot]
                        write_tensor_at(fds[kind][sg.slot], view.float(), 4 * sg.lo)  # fp32 files
                    if after is not None:
                        after(k)

                run_pipelined(len(self.subgroups), self.buffer_count, self.read, step,
                              lambda k, b: Completed())
                doing = directory  # the closing fsyncs and renames
        except OSError as exc:
            err = self._error(exc, "writing", exc.filename or doing)
            if err is exc:  # a swap read in the pipeline, already named
                raise
            raise err from exc
        return {kind: [_map(p, n) for p, n in zip(paths[kind], slot_numels)] for kind in KINDS}

    def gather_kind(self, kind: str, slot: int, numel: int) -> torch.Tensor:
        """One kind of one slot in host RAM (the external master itself; else read back)."""
        if kind == "master" and self.external is not None:
            return self.external[slot].detach()
        out = torch.zeros(numel, dtype=torch.float32)
        i = KINDS.index(kind)
        mine = [sg.index for sg in self.subgroups if sg.slot == slot]

        def step(j: int, b: int) -> None:
            sg = self.subgroups[mine[j]]
            out[sg.lo:sg.hi].copy_(self.views(mine[j], b)[i])

        run_pipelined(len(mine), self.buffer_count, lambda j, b: self.read(mine[j], b), step,
                      lambda j, b: Completed())
        return out

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.buffers = []
        shutil.rmtree(self.directory, ignore_errors=True)


def _file_layout(numel: int, dtypes: Sequence[torch.dtype]) -> tuple[list[tuple[int, torch.dtype]], int]:
    """Where each kind of a sub-group of ``numel`` elements lies in its swap file: (byte offset,
    dtype) per kind, each region padded to :data:`~.aio.ALIGN` bytes, and the file's size."""
    out, offset = [], 0
    for dt in dtypes:
        out.append((offset, dt))
        offset += round_up(numel * dt.itemsize)
    return out, offset


def _map(path: str, numel: int) -> torch.Tensor:
    """A read-only-in-spirit (private, copy-on-write) memory map of an fp32 file."""
    if numel == 0:
        return torch.zeros(0, dtype=torch.float32)
    return torch.from_file(path, shared=False, size=numel, dtype=torch.float32)
