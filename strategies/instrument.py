"""Instrumentation points: where the loop, the step and every collective the strategies issue tell
an attached monitor what they are doing (``callbacks/measure/resources.py``: ``ResourceMonitor``;
``callbacks/measure/comms.py``: ``CommsLogger``).

Nothing is attached by default. Then every hook below is one read of a module global and a
return, so an unmonitored run pays nothing measurable; and no hook ever reads or writes a
tensor's values (a monitor sees times and sizes only), so attaching one never changes numbers.

Two kinds of listener:

* a *timer* (at most one): told which phase of the step runs (``phase``: the Trainer's progress
  ticks, the step's parameter refresh, ``section`` for checkpoint I/O) and how long the caller sat
  blocked waiting for communication (``wait_begin``/``wait_end`` around each ``handle.wait()`` in
  ``zero/comm/inflight.py``, ``blocking`` around a synchronous collective, ``blocked_for`` where a
  library waits out of our sight: DDP's reducer);
* *sinks* (any number): told of every collective when it is issued (``issued``, ``blocking``),
  as a :class:`Collective` whose ``t_done`` is filled in when the collective completes; a sink
  with a ``disk(event)`` method is also told of every read and write of NVMe offload's swap
  files when it completes (``disk_io``, from the I/O thread), as a :class:`DiskIO`. The time
  the step sat blocked on such I/O goes to the timer as ``blocked(seconds, "io_wait")``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist

#: the one timer (None: no monitor attached)
_timer: "Timer | None" = None
#: the collective listeners
_sinks: tuple["Sink", ...] = ()


class Timer(Protocol):
    def phase(self, name: str) -> None: ...
    def enter(self, name: str) -> str:
        """Switch to phase ``name``; returns the phase left (to ``enter`` it again)."""
    def blocked(self, seconds: float, part: str = "comm_wait") -> None:
        """The caller just spent ``seconds`` blocked (on communication, or ``part="io_wait"`` on
        disk I/O), inside the current phase."""


class Sink(Protocol):
    def collective(self, event: "Collective") -> None: ...


class Collective:
    """One collective: ``op``, the message size in bytes (``nbytes``: the whole buffer - an
    all-gather's output, a reduce-scatter's input - as nccl-tests and DeepSpeed count it),
    ``group_size`` ranks, and when it was issued and completed (``perf_counter`` seconds;
    ``t_done`` None until then, or when the backend offers no completion callback). ``control``:
    the loop's own agreement (``Strategy.reduce``/``any_rank``/``barrier``/``broadcast``: metrics,
    stop flags), not the model's traffic that the ZeRO formulas count."""

    __slots__ = ("op", "nbytes", "group_size", "t_issue", "t_done", "blocking", "step", "kind", "control", "group")

    def __init__(self, op: str, nbytes: int, group_size: int, blocking: bool = False, control: bool = False,
                 group: str = "world") -> None:
        self.op, self.nbytes, self.group_size, self.blocking = op, nbytes, group_size, blocking
        self.control = control
        #: which process group: "world", a mesh axis ("data", "sequence", "tensor"), "replicas"
        #: (``name_group``), else "<n> ranks"
        self.group = group
        self.t_issue, self.t_done = time.perf_counter(), None
        self.step: Any = None  # set by a sink (which training step it belongs to)
        self.kind = ""

    @property
    def seconds(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_issue

    def finish(self, _: Any = None) -> None:
        self.t_done = time.perf_counter()


# ---------------------------------------------------------------------- attaching
def attach_timer(timer: Timer | None) -> None:
    """Set (or clear, None) the one timer; the ResourceMonitor does this while a fit runs."""
    global _timer
    _timer = timer


def add_sink(sink: Sink) -> None:
    global _sinks
    if sink not in _sinks:
        _sinks = _sinks + (sink,)


def remove_sink(sink: Sink) -> None:
    global _sinks
    _sinks = tuple(s for s in _sinks if s is not sink)


def active() -> bool:
    """Whether anything listens: strategies add optional machinery (DDP's comm hook) only then."""
    return _timer is not None or bool(_sinks)


# ---------------------------------------------------------------------- the timer's hooks
def phase(name: str) -> None:
    """The loop (or the step) moves on to ``name``."""
    if _timer is not None:
        _timer.phase(name)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Time the body as phase ``name``, then return to the phase it interrupted."""
    timer = _timer
    if timer is None:
        yield
        return
    prev = timer.enter(name)
    try:
        yield
    finally:
        timer.enter(prev)


def wait_begin() -> float | None:
    """Call before blocking on a collective's handle; pass the result to ``wait_end``."""
    return time.perf_counter() if _timer is not None else None


def wait_end(started: float | None, part: str = "comm_wait") -> None:
    if started is not None and _timer is not None:
        _timer.blocked(time.perf_counter() - started, part)


def blocked_for(seconds: float) -> None:
    """A wait measured (or estimated) by the caller, e.g. inside a library's own code."""
    if _timer is not None and seconds > 0:
        _timer.blocked(seconds)


# ---------------------------------------------------------------------- collectives
def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_size(group: object = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


#: process groups (by torch's name of the group: one group may come back as several Python
#: objects) -> the name their collectives are filed under (``name_group``)
_NAMES: dict[object, str] = {}


def _key(group: object) -> object:
    return getattr(group, "group_name", None) or id(group)


def name_group(group: object, name: str) -> None:
    """File ``group``'s collectives under ``name`` (the strategy mesh names its axes' groups); the
    default group stays "world" (a mesh axis over every rank is that group)."""
    if group is not None and group is not dist.group.WORLD:
        _NAMES[_key(group)] = name


def group_name(group: object = None) -> str:
    if group is None or (dist.is_available() and dist.is_initialized() and group is dist.group.WORLD):
        return "world"
    return _NAMES.get(_key(group), f"{group_size(group)} ranks")


def issued(op: str, work: Any, group: object, message: torch.Tensor, ranks: int = 1) -> Any:
    """Collective ``op`` over ``group`` was launched as ``work`` (an async handle); its message
    is ``message`` (times ``ranks``: a gather's per-rank input). Returns ``work`` unchanged. Sinks
    learn its completion time from the handle's future."""
    if not _sinks:
        return work
    event = Collective(op, nbytes(message) * ranks, group_size(group), group=group_name(group))
    try:
        work.get_future().then(event.finish)
    except (AttributeError, RuntimeError):  # a backend/op without futures: the latency stays unknown
        pass
    _tell(event)
    return work


@contextlib.contextmanager
def blocking(op: str, message: torch.Tensor | None, group: object = None, control: bool = False) -> Iterator[None]:
    """A synchronous collective (or point-to-point transfer) in the body: logged, and its whole
    duration counted as time blocked on communication. ``message`` None: a barrier, or an object
    whose pickled size is not seen (0 bytes); ``control``: see :class:`Collective`."""
    if _timer is None and not _sinks:
        yield
        return
    size = nbytes(message) if message is not None else 0
    event = Collective(op, size, group_size(group) if op not in ("send", "recv") else 2, blocking=True,
                       control=control, group=group_name(group))
    _tell(event)
    try:
        yield
    finally:
        event.finish()
        if _timer is not None:
            _timer.blocked(event.t_done - event.t_issue)


def point_to_point(sends: list[tuple], recvs: list[tuple]) -> None:
    """Posted ``(tensors, peer[, tag])`` sends and receives (the pipeline's), each tensor one
    transfer; their wait is timed where it happens (``wait_begin``/``wait_end``)."""
    if not _sinks:
        return
    for op, messages in (("send", sends), ("recv", recvs)):
        for tensors, *_ in messages:
            for t in tensors:
                event = Collective(op, nbytes(t), 2)
                event.t_done = event.t_issue  # the latency of a posted transfer is not observed
                _tell(event)


def _tell(event: Collective) -> None:
    for sink in _sinks:
        sink.collective(event)


# ---------------------------------------------------------------------- disk I/O
class DiskIO:
    """One piece of a swap file read or write (``kind`` "read" or "write"), ``nbytes`` long, that
    ran from ``t_start`` to ``t_done`` (``perf_counter`` seconds) on an I/O thread."""

    __slots__ = ("kind", "nbytes", "t_start", "t_done")

    def __init__(self, kind: str, nbytes: int, t_start: float, t_done: float) -> None:
        self.kind, self.nbytes, self.t_start, self.t_done = kind, nbytes, t_start, t_done


def disk_listened() -> bool:
    """Whether any sink takes disk events (the I/O threads time their pieces only then)."""
    return any(hasattr(s, "disk") for s in _sinks)


def disk_io(kind: str, nbytes: int, t_start: float, t_done: float) -> None:
    """A piece of swap-file I/O finished (called on the I/O thread)."""
    event = DiskIO(kind, nbytes, t_start, t_done)
    for sink in _sinks:
        if hasattr(sink, "disk"):
            sink.disk(event)
