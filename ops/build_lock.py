"""The build lock of :mod:`zerotrain.ops.builder`: one process builds an op's folder at a time.

Building takes ``zerotrain.lock`` in the op's build folder (created with O_CREAT|O_EXCL; it records
the owner's PID, host and start time). A process that finds the lock held waits, saying for whom,
for at most ``$ZEROTRAIN_BUILD_TIMEOUT_S`` seconds (default 600), then raises
:class:`BuildLockTimeout`; a lock whose owner is dead (same host: the PID is gone) is taken over at
once, and so is the ``lock`` file that ``cpp_extension``'s own baton leaves behind when a build is
killed (which would otherwise make every later build wait forever).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from typing import Iterator, Optional

log = logging.getLogger("zerotrain.ops.builder")

BUILD_TIMEOUT_ENV = "ZEROTRAIN_BUILD_TIMEOUT_S"
DEFAULT_BUILD_TIMEOUT_S = 600.0
LOCK_NAME = "zerotrain.lock"  # ours
BATON_NAME = "lock"  # torch.utils.cpp_extension's FileBaton


def build_timeout_s() -> float:
    """How long to wait for another process's build: $ZEROTRAIN_BUILD_TIMEOUT_S, default 600."""
    value = os.environ.get(BUILD_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{BUILD_TIMEOUT_ENV}={value!r} must be a number of seconds >= 0")
    return seconds


class BuildLockTimeout(TimeoutError):
    """Another process held an op's build lock for longer than $ZEROTRAIN_BUILD_TIMEOUT_S."""


def _say(message: str) -> None:
    """One line on stderr (and the log): what a build is doing, so nothing is silent."""
    log.info(message)
    print(message, file=sys.stderr, flush=True)


def _read_lock(path: str) -> tuple[Optional[dict], Optional[os.stat_result]]:
    """The lock's owner record and stat (None, None if it is gone; None, stat if unreadable)."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
        return (owner if isinstance(owner, dict) else None), st
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        try:
            return None, os.stat(path)
        except FileNotFoundError:
            return None, None


def owner_alive(owner: dict) -> Optional[bool]:
    """True/False for an owner on this host (a zombie counts as dead); None for another host."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _stale_reason(owner: Optional[dict], st: os.stat_result, timeout_s: float) -> Optional[str]:
    """Why a held lock can be taken over, or None if its owner may still be building."""
    age = time.time() - st.st_mtime
    if owner is None:  # created but never written: its owner died at once
        return f"an unreadable lock {age:.0f} s old" if age > 30 else None
    alive = owner_alive(owner)
    if alive is False:
        return f"its owner pid {owner.get('pid')} on {owner.get('host')} is dead"
    if alive is None and age > timeout_s:  # another host: we can only judge by age
        return f"its owner on host {owner.get('host')} has held it for {age:.0f} s"
    return None


def _take_over(path: str, st: os.stat_result) -> None:
    """Remove a stale lock, unless another waiter already replaced it (judged by inode)."""
    aside = f"{path}.stale.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if os.stat(aside).st_ino == st.st_ino:
        os.unlink(aside)
    else:  # a fresh lock from a faster waiter: put it back
        os.rename(aside, path)


def _describe(owner: Optional[dict]) -> str:
    if owner is None:
        return "an unknown process"
    started = owner.get("started")
    since = time.strftime("%H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid')} on host {owner.get('host')} (building {owner.get('op', '?')} since {since})"


@contextlib.contextmanager
def build_lock(directory: str, what: str = "", timeout_s: Optional[float] = None,
               poll_s: float = 0.2) -> Iterator[str]:
    """Hold ``<directory>/zerotrain.lock`` (see this module's docstring); yields its path.

    Also removes a stale ``cpp_extension`` baton (``<directory>/lock``): every zerotrain build
    takes this lock first, so while we hold it, that file is a leftover of a killed build.
    """
    timeout_s = build_timeout_s() if timeout_s is None else timeout_s
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "op": what}
    start, announced = time.monotonic(), False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
            break
        owner, st = _read_lock(path)
        if st is None:  # released just now
            continue
        stale = _stale_reason(owner, st, timeout_s)
        if stale is not None:
            _say(f"zerotrain: taking over the build lock {path} ({stale})")
            _take_over(path, st)
            continue
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise BuildLockTimeout(
                f"gave up after {waited:.0f} s waiting for the build lock {path}, held by "
                f"{_describe(owner)}. If that process is not building anymore, delete the file; "
                f"to wait longer, raise ${BUILD_TIMEOUT_ENV} (now {timeout_s:g})."
            )
        if not announced and owner is not None:
            _say(f"zerotrain: waiting up to {timeout_s:g} s (${BUILD_TIMEOUT_ENV}) for "
                 f"{_describe(owner)} to finish with {path}")
            announced = True
        time.sleep(poll_s)
    try:
        baton = os.path.join(directory, BATON_NAME)
        if os.path.exists(baton):
            _say(f"zerotrain: removing {baton}, left by a build that was killed")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(baton)
        yield path
    finally:
        owner, _ = _read_lock(path)
        if owner == me:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
