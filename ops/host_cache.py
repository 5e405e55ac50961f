"""A host allocator cache that never raises a rank's peak memory (csrc/host_cache/host_cache.cpp).

:func:`enable` puts the compiled cache in front of torch's CPU allocator for blocks of at least
``min_bytes``: a freed block is kept, and the next large allocations take its pages: a kept block of
their size, else the first pages of a larger one, else pages moved from kept blocks into a new
mapping (``mremap``). Fresh pages are mapped only where the kept ones run out, that is when the
blocks in use reach a new high, so after a training step's first pass its allocations stop costing
page faults. The large blocks in use plus those kept never exceed the most ever in use at once
(plus the slack), so the rank's peak stays what it was without the cache.

Without the compiled op (no compiler, ``ZEROTRAIN_BUILD_OPS=0``) :func:`enable` returns False and
torch's own allocator stays, after the builder's one warning. So it does in a process started with
``THP_MEM_ALLOC_ENABLE=1``: that asks torch's allocator for transparent huge pages, which the
cache's 4 KiB pages would silently drop.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from . import builder

log = logging.getLogger("zerotrain")


def torch_thp_requested() -> bool:
    """Whether ``THP_MEM_ALLOC_ENABLE`` asks torch's CPU allocator for transparent huge pages."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"  # torch's own reading: "0" or "1"


def enable(min_bytes: int, slack_bytes: int = 0) -> bool:
    """Cache freed host blocks of at least ``min_bytes``, holding at most ``slack_bytes`` above the
    high-water mark of the blocks in use; False where the op is unavailable, or where torch's
    allocator was asked for huge pages (:func:`torch_thp_requested`)."""
    if torch_thp_requested():
        log.info("host cache: THP_MEM_ALLOC_ENABLE=1 asks torch's allocator for huge pages; the cache "
                 "stays off so that allocator serves them")
        return False
    module = builder.host_cache_module()  # builds it on first use
    return bool(module is not None and module.install(int(min_bytes), int(slack_bytes)))


def disable() -> None:
    """Restore the allocator that was there before and free every kept block."""
    module = builder.loaded_module(builder.HOST_CACHE)
    if module is not None:
        module.uninstall()


def empty() -> int:
    """Free every kept block and restart the high-water mark; the bytes freed (0 if not loaded)."""
    module = builder.loaded_module(builder.HOST_CACHE)
    return int(module.empty()) if module is not None else 0


def stats() -> Optional[dict[str, int]]:
    """Counters (hits, misses, carved, assembled, evicted) and bytes (live, cached, peak, fresh:
    mapped afresh); None if not loaded."""
    module = builder.loaded_module(builder.HOST_CACHE)
    return dict(module.stats()) if module is not None else None
