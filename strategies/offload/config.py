"""The offload policy: where fp32 master weights, optimizer state and (ZeRO-3) parameter shards
live, and how they are moved. Validated once, when the strategy is built; every error names the
field, its value and the valid choices."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Optional

from ..options import check_bool, check_choice, whole_number
from .aio import ALIGN

OPTIMIZER_DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")

#: kernel file systems that hold no files of ours (writes fail, or land in a device table)
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs",
    "pstore", "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs", "selinuxfs",
    "nsfs", "rpc_pipefs", "hugetlbfs"})
#: kernel trees refused whatever a container mounts there (its /dev is often a plain tmpfs)
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
_REAL_UNDER_PSEUDO = ("/dev/shm",)  # a real (RAM-backed) file system


def _unescape_mount(field: str) -> str:
    # /proc/self/mounts writes space, tab, newline and backslash as octal escapes
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def mount_of(path: str) -> Optional[tuple[str, str]]:
    """(mount point, file-system type) of the mount holding the existing ``path``, from
    ``/proc/self/mounts``; None where that file cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real, best = os.path.realpath(path), None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt, fstype = _unescape_mount(parts[1]), parts[2]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and (best is None or len(mnt) >= len(best[0])):  # later mounts hide earlier ones
            best = (mnt, fstype)
    return best


def pseudo_filesystem(path: str, existing: Optional[str] = None) -> Optional[str]:
    """Why ``path`` lies on a kernel pseudo-filesystem (/proc, /sys, /dev but /dev/shm, or a mount
    of such a type), or None. ``existing``: its nearest existing ancestor, if ``path`` is not there."""
    real = os.path.realpath(path)
    mount = mount_of(existing or real)

    def inside(root: str) -> bool:
        return real == root or real.startswith(root + "/")

    under = next((r for r in PSEUDO_ROOTS if inside(r)), None)
    if under and not any(inside(r) for r in _REAL_UNDER_PSEUDO):
        return f"is under {under}, a kernel pseudo-filesystem ({mount[1] if mount else 'not a disk'})"
    if mount is not None and mount[1] in PSEUDO_FILESYSTEMS:
        return f"is on a {mount[1]} pseudo-filesystem (mounted at {mount[0]})"
    return None


def directory_problem(path: object, create: bool = True) -> Optional[str]:
    """Why ``path`` cannot hold files written by this run, or None when it can: it must be a
    directory (or, with ``create``, not exist yet under a directory that does), not on a pseudo
    file system, and writable, tested by creating and removing a small file (permission bits lie
    to root, and read-only mounts show only on writing)."""
    if not isinstance(path, str) or not path:
        return "must name a directory"
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isdir(real):
        return "exists and is not a directory"
    existing = real
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing!r} is not a directory"
    if existing != real and not create:
        return "does not exist"
    pseudo = pseudo_filesystem(real, existing)
    if pseudo:
        return pseudo
    try:
        fd, probe = tempfile.mkstemp(prefix=".zerotrain-write-test-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        what = "is not writable" if existing == real else f"cannot be created: {existing!r} is not writable"
        return f"{what} ({exc.strerror or exc})"
    return None


@dataclass(frozen=True)
class OffloadPolicy:
    """Where fp32 master weights, optimizer state and (ZeRO-3) parameter shards live, and how
    they move. Composed with a ZeRO stage (2 or 3) by ``Offload(stage=..., ...)``."""

    #: where fp32 master weights and Adam state live: "cpu" (host RAM) or "nvme" (files)
    optimizer_device: str = "cpu"
    #: where ZeRO-3 parameter shards live between uses: "none" (with the working params), "cpu"
    #: or "nvme"; anything but "none" needs stage=3
    param_device: str = "none"
    #: directory for swap files (required when a device is "nvme"); each rank makes its own
    #: sub-directory and removes it at the end
    nvme_path: Optional[str] = None
    #: page-lock host staging buffers (only meaningful with a CUDA device)
    pin_memory: bool = True
    #: staging buffers for swapped sub-groups (2 = double buffering; 4 also overlaps write-backs)
    buffer_count: int = 4
    #: elements of this rank's partition stepped (and swapped) together
    sub_group_size: int = 10_000_000
    #: threads doing swap-file I/O
    io_threads: int = 2
    #: bytes per I/O request handed to one thread (a multiple of 4096)
    io_block_size: int = 8 << 20
    #: use O_DIRECT where the file system supports it (detected at set-up; else buffered I/O)
    direct_io: bool = True

    def __post_init__(self) -> None:
        for f in ("buffer_count", "sub_group_size", "io_threads", "io_block_size"):
            object.__setattr__(self, f, whole_number("Offload", f, getattr(self, f), 1))
        for f in ("pin_memory", "direct_io"):
            check_bool("Offload", f, getattr(self, f))
        check_choice("Offload", "optimizer_device", self.optimizer_device, OPTIMIZER_DEVICES)
        check_choice("Offload", "param_device", self.param_device, PARAM_DEVICES)
        if self.uses_nvme:
            if not isinstance(self.nvme_path, str) or not self.nvme_path:
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r} must name a directory when "
                                 f"optimizer_device={self.optimizer_device!r} and "
                                 f"param_device={self.param_device!r} (a device is 'nvme')")
            problem = directory_problem(self.nvme_path)
            if problem:
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r}: {problem}; valid: a writable "
                                 f"directory on a local disk (created if missing), e.g. /local_nvme/zerotrain")
        if self.io_block_size < ALIGN or self.io_block_size % ALIGN:
            raise ValueError(f"Offload: io_block_size={self.io_block_size!r} must be a positive "
                             f"multiple of {ALIGN} bytes")

    @property
    def uses_nvme(self) -> bool:
        return self.optimizer_device == "nvme" or self.param_device == "nvme"
