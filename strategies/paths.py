"""Where files may go: a directory on a real file system (not /proc, /sys or /dev, nor a kernel
pseudo-filesystem mounted elsewhere) that exists or can be created and is writable. Used by the
offload policy (``nvme_path``) and the command line (``trainer.default_root_dir``, ``data.path``)."""
from __future__ import annotations

import os
import tempfile
from typing import Optional

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
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
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
