"""Asynchronous file I/O for swapping tensors to NVMe: a thread pool of ``pread``/``pwrite`` calls
on page-aligned buffers, ``O_DIRECT`` where the file system takes it, and atomic file writes.

Why threads: ``os.pread``/``os.pwrite`` release the GIL, so a pool of a few threads keeps several
requests in flight (an NVMe drive needs queue depth) while the main thread runs the optimizer
kernel, which releases the GIL too. Each request is cut into ``block_bytes`` pieces spread over the
pool; :class:`IOHandle` is the one object a caller waits on.

``O_DIRECT`` bypasses the page cache, so swapped state does not come back into RAM as cache (that
is the point of swapping) and the bandwidth is the drive's. It needs the buffer address, the file
offset and the length to be multiples of the logical block size; :func:`aligned_empty` gives such
buffers and the swap layout pads every region to :data:`ALIGN`. Some file systems refuse it
(tmpfs before Linux 6.6, some overlay and network file systems): :func:`probe_direct_io` tries a
real aligned write and read in the target directory and says which mode will be used and why.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .. import instrument

#: alignment (bytes) of buffers, file offsets and lengths: a page, which covers 512 B and 4 KiB
#: logical blocks
ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int, unit: int = ALIGN) -> int:
    return -(-n // unit) * unit


def aligned_empty(nbytes: int, align: int = ALIGN, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of ``round_up(nbytes, align)`` bytes whose address is a multiple of
    ``align`` (a view into a slightly larger allocation). ``pin``: page-locked (needs CUDA)."""
    n = round_up(max(nbytes, 1), align)
    raw = torch.empty(n + align, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % align
    return raw[start:start + n]


def _buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy, no numpy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"file I/O needs a contiguous CPU tensor, got {t.device} "
                         f"{'contiguous' if t.is_contiguous() else 'non-contiguous'}")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


@dataclass(frozen=True)
class DirectIOProbe:
    """Whether ``O_DIRECT`` works in a directory, and why not if it does not."""

    supported: bool
    reason: str

    @property
    def mode(self) -> str:
        return "O_DIRECT" if self.supported else "buffered"


def probe_direct_io(directory: str, align: int = ALIGN) -> DirectIOProbe:
    """Open a scratch file in ``directory`` with ``O_DIRECT``, write and read back one aligned
    block. Any refusal (EINVAL from open or from the I/O) means buffered I/O."""
    if not _O_DIRECT:
        return DirectIOProbe(False, "this platform has no O_DIRECT")
    path = os.path.join(directory, f".zerotrain_odirect_probe_{os.getpid()}_{threading.get_ident()}")
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o600)
        buf = aligned_empty(align, align)
        buf.fill_(0x5A)
        if os.pwrite(fd, _buffer(buf), 0) != align:
            return DirectIOProbe(False, "short O_DIRECT write")
        back = aligned_empty(align, align)
        if os.preadv(fd, [_buffer(back)], 0) != align or not torch.equal(back, buf):
            return DirectIOProbe(False, "O_DIRECT read back differs")
        return DirectIOProbe(True, f"O_DIRECT write+read of {align} B succeeded in {directory}")
    except OSError as exc:
        return DirectIOProbe(False, f"O_DIRECT refused in {directory}: {exc.strerror or exc}")
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class OffloadIOError(OSError):
    """A file operation of NVMe offload failed; the message names the file and the ``nvme_path``
    setting that put it there, and ``errno`` is the OS's (e.g. ``ENOSPC``)."""


def offload_error(exc: OSError, action: str, path: str, nvme_path: str) -> OSError:
    """``exc`` as an :class:`OffloadIOError` naming ``path`` and ``nvme_path`` (unchanged if it is one)."""
    if isinstance(exc, OffloadIOError):
        return exc
    return OffloadIOError(exc.errno, f"NVMe offload (strategy nvme_path={nvme_path}): {action} {path} failed: "
                                     f"{exc.strerror or exc}")


class IOHandle:
    """The pieces of one read or write in flight; ``wait()`` returns when all are done and
    re-raises the first error (an OSError through ``on_error``, when given, to name the file)."""

    def __init__(self, futures: Sequence[Future], label: str = "",
                 on_error: Callable[[OSError], BaseException] | None = None) -> None:
        self.futures, self.label, self.on_error = list(futures), label, on_error

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        started = instrument.wait_begin() if not self.done() else None
        try:
            for f in self.futures:
                try:
                    f.result()
                except OSError as exc:
                    err = exc if self.on_error is None else self.on_error(exc)
                    if err is exc:
                        raise
                    raise err from exc
        finally:
            instrument.wait_end(started, "io_wait")


class Completed(IOHandle):
    """A handle with nothing to wait for (RAM-resident state)."""

    def __init__(self, label: str = "") -> None:
        super().__init__((), label)


class AsyncFileIO:
    """A pool of ``threads`` workers doing positional reads and writes of tensor memory."""

    def __init__(self, threads: int = 2, block_bytes: int = 8 << 20) -> None:
        if threads < 1:
            raise ValueError(f"AsyncFileIO: threads={threads} must be >= 1")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"AsyncFileIO: block_bytes={block_bytes} must be a positive multiple of {ALIGN}")
        self.block_bytes, self.threads = block_bytes, threads
        self._pool: ThreadPoolExecutor | None = None  # started on first use, again after close()
        #: bytes moved since construction (tests and logs read these)
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="zerotrain-aio")
        return self._pool

    def _split(self, t: torch.Tensor, offset: int) -> list[tuple[memoryview, int]]:
        view, step = _buffer(t), self.block_bytes
        return [(view[s:s + step], offset + s) for s in range(0, len(view), step)]

    def write(self, fd: int, t: torch.Tensor, offset: int = 0, label: str = "",
              on_error: Callable[[OSError], BaseException] | None = None) -> IOHandle:
        """Write ``t``'s bytes at ``offset``. ``t`` must stay alive and unchanged until waited."""
        pieces = self._split(t, offset)
        self.bytes_written += sum(len(v) for v, _ in pieces)
        fn = _timed(_pwrite_all, "write") if instrument.disk_listened() else _pwrite_all
        return IOHandle([self.pool.submit(fn, fd, v, o) for v, o in pieces], label, on_error)

    def read(self, fd: int, t: torch.Tensor, offset: int = 0, label: str = "",
             on_error: Callable[[OSError], BaseException] | None = None) -> IOHandle:
        """Fill ``t`` from ``offset``. ``t`` must not be used until waited."""
        pieces = self._split(t, offset)
        self.bytes_read += sum(len(v) for v, _ in pieces)
        fn = _timed(_pread_all, "read") if instrument.disk_listened() else _pread_all
        return IOHandle([self.pool.submit(fn, fd, v, o) for v, o in pieces], label, on_error)

    def close(self) -> None:
        """Stop the worker threads (a later request starts them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _timed(io: Callable[[int, memoryview, int], None], kind: str) -> Callable[[int, memoryview, int], None]:
    """``io`` that tells the listening monitor of each piece it moved (``instrument.disk_io``)."""
    def run(fd: int, view: memoryview, offset: int) -> None:
        start = time.perf_counter()
        io(fd, view, offset)
        instrument.disk_io(kind, len(view), start, time.perf_counter())
    return run


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite returned {n} at offset {offset}")
        view, offset = view[n:], offset + n


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of swap file at offset {offset}")
        view, offset = view[n:], offset + n


def open_swap_file(path: str, nbytes: int, direct: bool) -> int:
    """Create (or truncate) a swap file of ``nbytes`` and return a read-write descriptor."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (_O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------------------- atomic files
def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str) -> Iterator[int]:
    """Write ``path`` all or nothing: yields a descriptor on ``path + ".tmp"``; on success the data
    is fsync'ed, renamed over ``path`` and the directory fsync'ed; on error the temp file is
    removed and an existing ``path`` is left as it was. A reader that opened (or mapped) the old
    ``path`` keeps seeing the old bytes: the rename swaps inodes."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        yield fd
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_tensor_at(fd: int, t: torch.Tensor, offset: int) -> None:
    """Synchronous buffered write of a tensor's bytes (for checkpoint copies)."""
    data = t.contiguous()  # keep a reference: the byte view does not
    _pwrite_all(fd, _buffer(data), offset)
