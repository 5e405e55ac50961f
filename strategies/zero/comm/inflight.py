"""Communication in flight: every collective ZeRO has launched and not yet waited for, and the one
place that waits on a collective's handle.

A caller launches a collective (``collectives.py``, always ``async_op=True``) and files an
:class:`InFlight` entry here under a key that says what the work is for. The entry holds the
handles, the buffers they read and write (kept alive until waited) and ``on_done``, the work to run
once the data has arrived (copy my slice out, release a pooled buffer, bind a unit's parameters).
As FSDP2 keeps its all-gather and reduce-scatter states as typed records of its param group, the
key types the entry:

* ``Work.BUCKETS`` (the default): gradient buckets reduced during backward, the chunks of the
  post-step parameter refresh, the set-up broadcasts. In launch order, at most ``max_in_flight``
  pending (the oldest is waited first: this bounds bucket memory), each waited at once when
  ``overlap`` is off, and entries that needed no communication (one rank) landed as soon as
  nothing older is pending; the end of backward waits for the key.
* ``Work.PARAMS``: ``overlap_param_gather``'s post-step all-gathers, still in flight when the step
  returns. Each entry names the parameters it writes: a forward waits only through the last gather
  writing its module's own parameters (``wait_writes``), every other reader for the key.
* a ZeRO-3 :class:`~.unit.Unit`: that unit's all-gather (at most one), waited when the unit is
  used; its ``on_done`` binds the parameters (GATHERING -> UNSHARDED).
* ``Work.NOW``: a collective whose result the caller needs before it goes on (``complete``).

Entries under one key are waited oldest first; keys are independent, so waiting for a unit's
gather does not wait for the reductions in flight, nor the end of backward for a prefetch. Only
``Work.BUCKETS`` is bounded here: gathers are bounded by their owners (ZeRO-3's
``max_live_parameters``, the planned chunks of the refresh).
"""
from __future__ import annotations

import enum
from collections import deque
from typing import Callable, Hashable, Iterable, NamedTuple

import torch

from ... import instrument
from .collectives import Done, Handle


class Work(enum.Enum):
    """What an entry is for (a ZeRO-3 unit's gather is filed under the unit itself)."""

    BUCKETS = "buckets"
    PARAMS = "params"
    NOW = "now"


class InFlight(NamedTuple):
    """A launched collective: who waits on it, what it keeps alive, what runs when it is done."""

    handles: tuple[Handle, ...]
    buffers: tuple[torch.Tensor, ...]
    on_done: Callable[[], None]
    label: str = ""
    #: ``id()`` of the parameters it writes (``Work.PARAMS``: what a module's forward waits for)
    writes: frozenset[int] = frozenset()


class InFlightQueue:
    """The one place ZeRO waits on communication: the pending entries by key, each key's in
    launch order (see the module docstring)."""

    def __init__(self, overlap: bool = True, max_in_flight: int = 2) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1")
        self.overlap = overlap
        self.max_in_flight = max_in_flight
        self._pending: dict[Hashable, deque[InFlight]] = {}
        #: how many collectives were filed since construction (tests read it to see overlap)
        self.launched = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._pending.values())

    def entries(self, key: Hashable) -> tuple[InFlight, ...]:
        """What is pending under ``key``, oldest first."""
        return tuple(self._pending.get(key, ()))

    def push(self, item: InFlight, key: Hashable = Work.BUCKETS) -> None:
        """File ``item`` under ``key``; only ``Work.BUCKETS`` may wait here (its bound, or no
        ``overlap``)."""
        self.launched += 1
        pending = self._pending.setdefault(key, deque())
        pending.append(item)
        if key is not Work.BUCKETS:
            return
        if not self.overlap:
            self.wait(key)
        # work that needed no communication (one rank) has nothing to overlap: land it now, oldest
        # first, so its buffers (a pooled bucket, a unit's whole reduced gradient) go back at once
        while pending and all(isinstance(h, Done) for h in pending[0].handles):
            self._land(pending)
        while len(pending) > self.max_in_flight:
            self._land(pending)

    def complete(self, handle: Handle, *keep: torch.Tensor, label: str = "") -> None:
        """File a collective the caller needs at once and wait for it (``keep``: its buffers)."""
        self.push(InFlight((handle,), keep, _nothing, label), Work.NOW)
        self.wait(Work.NOW)

    def wait(self, key: Hashable) -> None:
        """Wait for everything pending under ``key``, oldest first."""
        pending = self._pending.get(key)
        while pending:
            self._land(pending)
        self._pending.pop(key, None)

    def wait_writes(self, key: Hashable, params: Iterable[int]) -> None:
        """Wait (oldest first) through the last entry under ``key`` that writes one of ``params``
        (``id()`` of parameters); later entries stay in flight."""
        pending = self._pending.get(key)
        if not pending:
            return
        ids = frozenset(params)
        last = max((i for i, item in enumerate(pending) if item.writes & ids), default=-1)
        for _ in range(last + 1):
            self._land(pending)
        if not pending:
            self._pending.pop(key, None)

    def wait_all(self) -> None:
        """Wait for everything, key by key (for teardown)."""
        while self._pending:
            self.wait(next(iter(self._pending)))

    @staticmethod
    def _land(pending: deque[InFlight]) -> None:
        item = pending.popleft()
        started = instrument.wait_begin()  # time blocked here is the step's comm wait
        for h in item.handles:
            h.wait()
        instrument.wait_end(started)
        item.on_done()


def _nothing() -> None:
    pass
