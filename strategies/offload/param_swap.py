"""ZeRO-3 parameter shards on NVMe (``param_device="nvme"``): each unit's shards live in files and
take RAM only while they are used.

How: a unit's fp32 master shard (and its bf16/fp16 working shard in mixed precision) is moved
into a file under ``nvme_path`` and the tensor is re-pointed at a *shared memory mapping* of that
file (:class:`MappedShard`). Every piece of ZeRO-3 that reads or writes the shard (the all-gather,
the optimizer, checkpoints, ``full_state_dict``) keeps working on an ordinary tensor; what changes
is when its pages are resident:

* ``unshard_async`` (the runtime calls it ``prefetch_bucket_size`` ahead of use) first asks the
  kernel to read the shard in (``madvise(MADV_WILLNEED)``: asynchronous readahead), so the data
  is fetched ahead of the all-gather that consumes it. On one rank the "all-gather" is a copy
  that happens at once, so a prefetch there only starts the readahead (``prefetch_async``): the
  disk read overlaps the current unit's compute, and the unit takes no RAM until it is used;
* once the gather has landed in the unit's ``full`` buffer (``wait``), and again when the unit
  is resharded, the shard's pages are dropped from the process (``MADV_DONTNEED``; on a shared
  mapping dirty data stays in the page cache and reaches the file, nothing is lost);
* on one rank in fp32 compute the mapped master *is* the unit's gathered buffer
  (``SwappedUnit.mapped_full``): the forward and backward read the weights from the mapping, and
  resharding only drops its pages;
* the offloaded optimizer step prefetches each sub-group's master range one sub-group ahead,
  writes it back once stepped (``sync_file_range`` on the swapper's I/O threads, so the disk
  writes it while the next sub-group steps) and drops it (:class:`ShardPager`).

This goes through the page cache (buffered I/O with kernel readahead), not ``O_DIRECT``: the
resident set stays at the units in use, but the kernel may keep clean file pages cached until it
needs the memory. The optimizer state uses the O_DIRECT swapper (``swapper.py``).

A unit is switched to this behaviour by re-classing it (``unit.__class__ = SwappedUnit``, as
FSDP2 re-classes modules), so ZeRO-3's own ``Unit`` needs no option for it.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
import weakref
from typing import Sequence

import torch

from .. import instrument
from ..zero.stage3.unit import ShardState, Unit
from .aio import AsyncFileIO, IOHandle, offload_error
from .plan import SubGroup

_PAGE = mmap.PAGESIZE


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
#: ``sync_file_range`` (Linux): start writing a file range's dirty pages, wait for it
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _reserve(fd: int, nbytes: int) -> None:
    """Give the file ``nbytes`` of allocated blocks now, so that a full disk fails here (ENOSPC)
    rather than killing the process with SIGBUS at a later store through the mapping; a plain
    (sparse) truncate where the file system cannot allocate ahead."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


def _advise(t: torch.Tensor, advice: int, lo: int, hi: int | None, what: str = "a parameter file") -> None:
    """``madvise`` elements ``[lo, hi)`` of ``t``, a tensor that is a whole fresh mapping (so its
    start is page-aligned), widened to whole pages."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return
    start = (lo * t.element_size()) // _PAGE * _PAGE
    end = nbytes if hi is None else min(nbytes, hi * t.element_size())
    end = -(-end // _PAGE) * _PAGE
    if end > start and _libc.madvise(t.data_ptr() + start, end - start, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) on {what}: {os.strerror(err)}")


class MappedShard:
    """A 1-D tensor of ``numel`` elements backed by a shared mapping of ``path``. The mapping is
    the tensor's own storage (``torch.from_file(shared=True)``), so it lives exactly as long as
    some tensor uses it; ``close()`` only removes the file name."""

    def __init__(self, path: str, numel: int, dtype: torch.dtype, nvme_path: str | None = None) -> None:
        self.path, self.numel, self.dtype = path, numel, dtype
        self.nbytes = numel * dtype.itemsize
        self._fd: int | None = None
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            _reserve(self._fd, max(self.nbytes, 1))
        except OSError as exc:
            self.close()
            raise offload_error(exc, "creating", path,
                                nvme_path or os.path.dirname(os.path.dirname(os.path.abspath(path)))) from exc
        self.tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype) if numel else \
            torch.empty(0, dtype=dtype)

    def prefetch(self, lo: int = 0, hi: int | None = None) -> None:
        """Start reading ``[lo, hi)`` in (kernel readahead; returns at once)."""
        _advise(self.tensor, mmap.MADV_WILLNEED, lo, hi, self.path)

    def release(self, lo: int = 0, hi: int | None = None) -> None:
        """Drop ``[lo, hi)``'s pages from this process (the data stays in the file/page cache)."""
        _advise(self.tensor, mmap.MADV_DONTNEED, lo, hi, self.path)

    def write_back(self, lo: int = 0, hi: int | None = None) -> None:
        """Write ``[lo, hi)``'s dirty pages to the file now and return when they are on the way
        to the disk (``sync_file_range``: blocking; the optimizer step runs it on its I/O threads,
        so the disk writes each stepped range while the next one steps, instead of the kernel's
        flusher writing the whole master at its own pace and throttling the step when the dirty
        pages pile up). Without ``sync_file_range`` (not Linux) a no-op: the kernel writes them."""
        if _sync_file_range is None or self._fd is None:  # not Linux, or closed
            return
        size = self.dtype.itemsize
        start = lo * size // _PAGE * _PAGE
        end = self.nbytes if hi is None else min(self.nbytes, hi * size)
        if end <= start:
            return
        if _sync_file_range(self._fd, start, end - start, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"writing back {self.path}: {os.strerror(err)}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class FileChunks:
    """ZeRO-3's partitioned build with ``param_device="nvme"`` (``materialize.RamChunks``' other
    choice): each chunk of at least ``min_bytes`` is a shared mapping of a file under
    ``directory`` whose name is removed at once (the data lives as long as the tensor, and so
    does its disk space); after each write or read its pages are dropped from the process (they
    reach the file through the page cache). Smaller chunks stay in RAM: they are few bytes and
    would each cost a mapping."""

    def __init__(self, directory: str, nvme_path: str | None = None, min_bytes: int = 1 << 20) -> None:
        self.directory, self.nvme_path, self.min_bytes = directory, nvme_path, min_bytes
        self._count = 0
        #: id() of each mapped chunk -> a weak reference to it (the build owns the chunks)
        self._mapped: dict[int, weakref.ref] = {}

    def new(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != "cpu" or numel * dtype.itemsize < self.min_bytes:
            return torch.zeros(numel, dtype=dtype, device=device)
        self._count += 1
        shard = MappedShard(os.path.join(self.directory, f"build{self._count:06d}.chunk"), numel, dtype,
                            self.nvme_path)
        shard.close()  # the name only: the mapping keeps the data
        key = id(shard.tensor)
        self._mapped[key] = weakref.ref(shard.tensor, lambda _, key=key: self._mapped.pop(key, None))
        return shard.tensor

    def settle(self, chunk: torch.Tensor) -> None:
        ref = self._mapped.get(id(chunk))
        if ref is not None and ref() is chunk:
            _advise(chunk, mmap.MADV_DONTNEED, 0, chunk.numel())


class SwappedUnit(Unit):
    """A ZeRO-3 unit whose master/working shards are :class:`MappedShard` tensors (``shards``:
    the master, then the working shard when it is a separate low-precision copy).

    ``mapped_full``: on one rank in fp32 compute the shard *is* the whole gathered buffer (the
    partition of one rank is every element, in the compute dtype), so ``full`` is the mapped
    master itself: gathering binds the parameters to views of the mapping (the pages come in
    from the page cache or the file as the forward reads them, after the readahead the prefetch
    started), with no allocation and no copy; resharding drops the pages from the process
    instead of freeing a buffer."""

    shards: list[MappedShard]
    mapped_full = False

    def unshard_async(self, group: object = None, secondary: bool = False) -> bool:
        if self.state is ShardState.SHARDED:
            self.shards[-1].prefetch()  # the working shard: what the all-gather reads
        if self.mapped_full:
            if self.state is not ShardState.SHARDED:
                return False
            self._landed()  # the views of the mapping are the gathered values
            return True
        started = super().unshard_async(group, secondary)
        if started and self.layout.world_size == 1:
            self.release()  # one rank: the copy into `full` is done already
        return started

    def _free(self) -> None:
        if self.mapped_full:
            self.release()  # the mapping is the shard: keep it, drop its pages from the process
        else:
            super()._free()

    def prefetch_async(self, group: object = None, secondary: bool = False) -> bool:
        if self.layout.world_size == 1:  # a copy would overlap nothing: read the file ahead only
            if self.state is ShardState.SHARDED:
                self.shards[-1].prefetch()
            return False
        return super().prefetch_async(group, secondary)

    def wait(self) -> None:
        super().wait()
        if not self.mapped_full:
            self.release()  # the gathered copy is in `full` now

    def reshard(self) -> None:
        super().reshard()
        self.release()

    def refresh(self, group: object = None, copy: bool = True) -> None:
        super().refresh(group, copy)
        self.release()

    def release(self) -> None:
        for s in self.shards:
            s.release()


def swap_unit_to_files(unit: Unit, directory: str, nvme_path: str | None = None) -> None:
    """Move a (non-persistent) unit's master and working shards into files in ``directory`` (a
    folder under the strategy's ``nvme_path``, its parent by default, which errors name) and
    re-class it."""
    if unit.persistent:
        return
    nvme_path = nvme_path or os.path.dirname(os.path.abspath(directory))
    shards = []
    master = MappedShard(os.path.join(directory, f"unit{unit.index:04d}.master"), unit.master.numel(),
                         torch.float32, nvme_path)
    master.tensor.copy_(unit.master)
    shards.append(master)
    if unit.working is unit.master:
        unit.master = unit.working = master.tensor
        if unit.layout.world_size == 1 and unit.full.dtype == torch.float32 and not unit.quant.weights \
                and unit.secondary is None and unit.full.numel() == master.tensor.numel():
            unit.full = master.tensor  # see SwappedUnit.mapped_full
            unit._views = unit.param_views(unit.full)
            unit.mapped_full = True
    else:
        working = MappedShard(os.path.join(directory, f"unit{unit.index:04d}.working"), unit.working.numel(),
                              unit.working.dtype, nvme_path)
        working.tensor.copy_(unit.working)
        shards.append(working)
        unit.master, unit.working = master.tensor, working.tensor
    unit.__class__ = SwappedUnit
    unit.shards = shards
    unit.release()


class ShardPager:
    """Prefetch, write back and release the file-backed master (and working) ranges the optimizer
    steps. ``slots[i]`` is ``(unit, start)``: slot i is the unit's master from ``start`` on.
    ``io``: the offload's I/O threads, which write each stepped range back
    (:meth:`MappedShard.write_back`) while the next sub-group steps; :meth:`finish` waits for them."""

    def __init__(self, subgroups: Sequence[SubGroup], slots: Sequence[tuple[Unit, int]], io: AsyncFileIO) -> None:
        self.subgroups, self.slots, self.io = list(subgroups), list(slots), io
        self._pending: list = []

    def _each(self, k: int):
        sg = self.subgroups[k]
        unit, start = self.slots[sg.slot]
        for s in getattr(unit, "shards", ()):
            yield s, start + sg.lo, start + sg.hi

    def prefetch(self, k: int) -> None:
        if k < len(self.subgroups):
            for s, lo, hi in self._each(k):
                s.prefetch(lo, hi)

    def release(self, k: int) -> None:
        for s, lo, hi in self._each(k):
            s.release(lo, hi)

    def stepped(self, k: int) -> None:
        """Sub-group k's ranges were stepped: start writing them back, then drop them. A
        listening monitor (``ResourceMonitor``) is told of each write-back as disk I/O."""
        timed = instrument.disk_listened()
        for s, lo, hi in self._each(k):
            self._pending.append(self.io.pool.submit(_timed_write_back if timed else MappedShard.write_back,
                                                     s, lo, hi))
            s.release(lo, hi)

    def finish(self) -> None:
        """Wait for the write-backs :meth:`stepped` started; re-raise the first error."""
        pending, self._pending = self._pending, []
        IOHandle(pending, "parameter file write-back").wait()


def _timed_write_back(shard: MappedShard, lo: int, hi: int) -> None:
    """``shard.write_back(lo, hi)``, reported to the monitors as a write of that range's bytes."""
    start = time.perf_counter()
    shard.write_back(lo, hi)
    instrument.disk_io("write", (hi - lo) * shard.dtype.itemsize, start, time.perf_counter())
