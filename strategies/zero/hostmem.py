"""Host memory for buffers that live one collective: fewer page faults per step.

On Linux a buffer of more than about 32 MB is a fresh ``mmap``: every 4 KiB page of it faults and
is zeroed by the kernel when first written, and ``munmap`` gives it back when freed. On the 2-core
machines of ``bench/RESULTS.md`` writing a fresh 64 MB buffer took 35 ms, against 6 ms for a reused
one; a ZeRO-3 step of the 118M GPT faulted about 280k pages per rank (DDP's: about 160k). Two
remedies, both for CPU tensors only (CUDA has its caching allocator):

* :func:`advise_huge_pages`: ask the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``)
  on a freshly allocated, not yet written buffer, so that it faults in 2 MiB pages: 11 ms instead
  of 35 for 64 MB. Memory is unchanged: only whole 2 MiB pages inside the buffer are advised.
  ZeRO-3's gathered parameters take it, since they are freed after their backward and gathered
  afresh each step. A no-op where the kernel lacks THP (``enabled`` is ``never``), off Linux, for
  small buffers, and with ``ZEROTRAIN_HUGE_PAGES=0``.
* :class:`SizedPool`: short-lived buffers kept by (size, dtype) for the next collective of the same
  shape (a transformer's blocks all have one size), for ZeRO++'s int8 codes and scales.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections import defaultdict

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
_ENV = "ZEROTRAIN_HUGE_PAGES"
_madvise = None  # resolved on first use: the libc function, or False where there is none


def huge_pages_enabled() -> bool:
    """Whether :func:`advise_huge_pages` does anything here: Linux, a libc with ``madvise``, THP
    not ``never``, and ``$ZEROTRAIN_HUGE_PAGES`` unset or 1."""
    global _madvise
    flag = os.environ.get(_ENV, "1")
    if flag not in ("0", "1"):
        raise ValueError(f"{_ENV}={flag!r}: valid choices: 0 (off), 1 (on, the default)")
    if flag == "0" or not sys.platform.startswith("linux"):
        return False
    if _madvise is None:
        _madvise = False
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                if "[never]" in f.read():
                    return False
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fn = libc.madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            pass
    return bool(_madvise)


def advise_huge_pages(t: torch.Tensor) -> int:
    """Advise the whole 2 MiB pages inside ``t``'s storage for transparent huge pages; call it
    before the buffer is first written. Returns the bytes advised (0: nothing done). Advice the
    kernel refuses is ignored: it only changes how the memory faults in, never its values."""
    if t.device.type != "cpu" or not huge_pages_enabled():
        return 0
    storage = t.untyped_storage()
    start = storage.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    return hi - lo if _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0 else 0


class SizedPool:
    """Buffers kept by (numel, dtype, device) once given back, handed out again for the same shape.

    What it holds is bounded by the most buffers of one shape in use at once (the collectives in
    flight), so its memory is what those collectives needed anyway, kept rather than returned and
    faulted in again. ``buffers()`` lists what it holds, for memory reports."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._made: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(numel, dtype, torch.device(device))]
        if free:
            return free.pop()
        t = torch.empty(numel, dtype=dtype, device=device)
        self._made.append(t)
        return t

    def give(self, *tensors: torch.Tensor) -> None:
        """Back to the pool: the caller no longer reads or writes them."""
        for t in tensors:
            self._free[(t.numel(), t.dtype, t.device)].append(t)

    def buffers(self) -> list[torch.Tensor]:
        return list(self._made)

    def clear(self) -> None:
        self._free.clear()
        self._made.clear()
