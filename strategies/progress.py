"""Progress marks: where the loop and the world-wide collectives tell the progress watchdog
(``trainer/launch/watchdog.py``) that this rank got one step further.

A rank blocked in a collective has *issued* it, so it counts one mark more than a peer stuck
before it: that difference is how the watchdog tells the rank everybody waits for from the
ranks that wait, even when both sit in the same phase of the loop (a ``sync_dist`` log or a
ZeRO-3 gather inside ``training_step``). Only collectives over the whole world are marked, so
every rank counts the same marks; pipeline point-to-point traffic is not.
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

_sink: Callable[[str], None] | None = None


def set_sink(sink: Callable[[str], None] | None) -> None:
    """The Trainer points this at its watchdog while a fit runs (None: marks cost nothing)."""
    global _sink
    _sink = sink


def mark(what: str, group: object = None) -> None:
    """This rank is about to issue collective ``what`` over ``group`` (None: the world)."""
    if _sink is None:
        return
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return
    _sink(what)
