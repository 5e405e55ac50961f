"""The host's memory as a rank sees it: what is free for this rank, and how freed tensors go back.

* :func:`set_mmap_threshold`: glibc serves an allocation below its *mmap threshold* from the heap
  and keeps what is freed there for reuse. The threshold starts at 128 KiB and, each time a block
  served by ``mmap`` is freed, rises to that block's size (up to 32 MiB on 64-bit). A training
  step allocates and frees tensors of a few MiB to tens of MiB (activations, each parameter's
  gradient, the logits), so after the first steps they all come from a heap that fragments, and
  a rank stays resident well above what it holds. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``)
  gives every allocation of at least that many bytes its own mapping, returned to the OS when it
  is freed. The price is the page faults of touching a fresh mapping; for large tensors that is
  small beside the work done on them (``bench/RESULTS.md``: 8 MiB on the 118M GPT).
* :func:`free_bytes_per_rank`: what this rank may still allocate: the device's free memory on
  CUDA; on the host, the kernel's ``MemAvailable`` (within the cgroup's limit) shared by the
  node's ranks, within this process's ``RLIMIT_DATA``.
"""
from __future__ import annotations

import ctypes
import logging
import platform
import resource

import torch

log = logging.getLogger("zerotrain")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_applied: int | None = None


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of at least ``nbytes`` with their own mapping (glibc only; a no-op
    elsewhere). 0 leaves glibc's own sliding threshold. Returns whether it was applied."""
    global _applied
    if nbytes <= 0:
        return False
    if _applied == nbytes:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.debug("host_mmap_threshold=%d: not glibc (%s), left as it is", nbytes, platform.libc_ver())
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    if mallopt(M_MMAP_THRESHOLD, int(nbytes)) != 1:
        log.warning("host_mmap_threshold=%d: glibc refused it (its limit is 32 MiB on 64-bit)", nbytes)
        return False
    _applied = nbytes
    return True


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _cgroup_room() -> int | None:
    """The cgroup's limit minus its usage (v2, then v1), or None without a limit."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            with open(usage) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return max(0, int(text) - used)
    return None


def free_bytes_per_rank(device: torch.device, local_world_size: int) -> int:
    """Bytes this rank may still allocate on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        free = _meminfo("MemAvailable")
    except (OSError, StopIteration):
        return 0
    room = _cgroup_room()
    if room is not None:
        free = min(free, room)
    free //= max(1, local_world_size)
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]  # a cap on this process alone
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        except (OSError, StopIteration):
            used = 0
        free = min(free, max(0, limit - used))
    return free
