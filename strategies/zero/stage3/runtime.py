"""What ZeRO-3 does at each event of a step; the hooks (``hooks.py``) only call these methods.

Events and what they do (``u`` is a unit, see ``unit.py``):

* ``enter_scope`` / ``exit_scope``: the outermost forward of the step (the Trainer's
  ``training_step`` / ``validation_step``, or ``model.generate(...)`` called directly) begins or
  ends. The root unit (embeddings, LM head ...) is gathered for the whole scope, and the first
  units are prefetched; after a grad-enabled scope the root stays gathered until the end of
  backward, after a ``no_grad`` scope everything is freed at once.
* ``pre_forward(u)``: gather ``u`` (waiting for its prefetch if one is in flight), then prefetch
  the units expected next. ``post_forward(u)``: free ``u`` (``reshard_after_forward``, or always
  under ``no_grad``), unless ``max_reuse_distance`` keeps it for its backward: once the step's
  orders are recorded, a unit whose backward comes within that many elements of other units'
  gathers stays gathered while the gathered units fit ``max_live_parameters``.
* ``pre_backward(u)`` (the first gradient reaches an output of ``u``): gather ``u`` again and
  prefetch the units expected next in backward. ``post_backward(u)`` (gradients reached ``u``'s
  inputs): once every forward call of ``u`` in this step has been backpropagated, reduce its
  gradients asynchronously into its gradient partition and free it. The flat gradient the
  reduction sends is ``u``'s own gathered buffer, whose values backward no longer needs (when the
  dtypes agree): no pooled buffer, and its memory is returned when the reduction lands.
* ``before_backward``: prefetch the units backward needs first. Until ``after_backward``, gathers
  read the node's copy (``hierarchical_partition``, hpZ) where the forward left one.
* ``after_backward``: reduce what is left (the root, persistent parameters, units whose inputs
  did not require grad, parameters used outside their unit), wait for every reduction, free all
  gathered units and the pooled reduction buffers.

Prefetch: the order units run in is recorded during the first grad-enabled forward and the first
backward; from then on ``pre_forward``/``pre_backward`` find the current unit in the recorded order
and launch the all-gathers of the following units, up to ``prefetch_bucket_size`` elements ahead,
while the current unit computes. A unit that does not run in a later step is simply freed at the
end of it. ``max_live_parameters`` bounds the gathered elements: a prefetch that would exceed it is
not issued, and before a needed gather idle gathered units are freed, least recently used first.
The same decisions are taken on every rank (they depend only on the order and on unit states), so
the collectives line up as long as every rank runs the same control flow - as FSDP requires.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm.collectives import BufferPool, SizedPool
from ..comm.inflight import InFlightQueue, Work
from .unit import ShardState, Unit

log = logging.getLogger("zerotrain")


@dataclass(frozen=True)
class RuntimeOptions:
    """What the runtime reads of ``Stage3Config`` (defaults there), with the resolved reduce mode."""

    reshard_after_forward: bool
    prefetch_bucket_size: int
    max_live_parameters: int
    reduce_mode: str
    max_reuse_distance: int = 0


class Stage3Runtime:
    def __init__(self, units: Sequence[Unit], options: RuntimeOptions, queue: InFlightQueue,
                 reduce_dtype: torch.dtype, group: object = None) -> None:
        self.units = list(units)
        self.root = self.units[0]
        self.options, self.queue, self.group = options, queue, group
        #: id(param) -> its unit, for the params that are ever sharded
        self.owner = {id(p): u for u in self.units if not u.persistent for p in u.params}
        buffer_numel = max([u.layout.padded_numel + u.reduce_space(options.reduce_mode, group)
                            for u in self.units] or [1])
        device = self.root.device
        self.pool = BufferPool(buffer_numel, reduce_dtype, device)
        self.grad_views: list[torch.Tensor] = []  # set by the strategy: the optimizer's order
        self.fwd_order: list[int] | None = None
        self.bwd_order: list[int] | None = None
        self._recording_fwd: list[int] | None = None
        self._recording_bwd: list[int] | None = None
        self._fwd_pos = self._bwd_pos = 0
        self._depth = 0  # nesting of scope forwards
        self._step_open = False  # a grad-enabled scope ran since the last backward
        self._clock = 0
        self._last_used: dict[int, int] = {}
        self.peak_live = 0  # the most gathered elements at any moment (tests reset it)
        #: when a list, every gather/free/forward/backward event is appended (for tests)
        self.trace: list[tuple[str, int]] | None = None
        self._warned: set[int] = set()
        self._reuse: dict[int, int] | None = None  # unit index -> reuse distance (_keeps)
        self._backward = False  # between before_backward and after_backward (hpZ's gathers)
        #: units kept gathered after their forward (``max_reuse_distance``) in the latest step
        self.kept: set[int] = set()

    # ------------------------------------------------------------------ helpers
    @property
    def live(self) -> int:
        return sum(u.numel for u in self.units if u.gathered and not u.persistent)

    def _event(self, what: str, u: Unit) -> None:
        if self.trace is not None:
            self.trace.append((what, u.index))

    def _gather(self, u: Unit, prefetch: bool = False) -> None:
        start = u.prefetch_async if prefetch else u.unshard_async
        if start(self.group, secondary=self._backward):
            self._event("prefetch" if prefetch else "gather", u)
            u.prefetched = prefetch
            self.peak_live = max(self.peak_live, self.live)

    def _use(self, u: Unit) -> None:
        """Gather ``u`` now (freeing idle units first if over budget) and wait for it."""
        if not u.gathered:
            self._make_room(u.numel)
            self._gather(u)
        u.wait()
        u.prefetched = False
        self._clock += 1
        self._last_used[u.index] = self._clock

    def _free(self, u: Unit) -> None:
        if u.gathered and not u.persistent:
            u.reshard()
            self._event("free", u)

    def _make_room(self, numel: int) -> None:
        budget = self.options.max_live_parameters
        if self.live + numel <= budget:
            return
        idle = [u for u in self.units if u.state is ShardState.UNSHARDED and not u.persistent
                and u.active == 0 and not u.pinned and not u.prefetched and not u.in_backward
                and not (u is self.root and (self._depth or self._step_open))]
        for u in sorted(idle, key=lambda v: self._last_used.get(v.index, 0)):
            if self.live + numel <= budget:
                break
            self._free(u)

    def _prefetch(self, order: list[int] | None, start: int) -> None:
        budget = self.options.prefetch_bucket_size
        if not order or budget <= 0:
            return
        ahead = 0
        for i in order[start:]:
            u = self.units[i]
            if ahead >= budget:
                break
            ahead += u.numel
            if u.state is ShardState.SHARDED:
                if self.live + u.numel > self.options.max_live_parameters:
                    break
                self._gather(u, prefetch=True)

    def _enter(self, u: Unit, event: str, recording: list[int] | None, order: list[int] | None,
               pos: int) -> int:
        """The start of ``u``'s forward or backward (``event``), the same for both: note ``u`` in
        the order being recorded (the first pass), gather it, then prefetch the units the recorded
        ``order`` has after it. Returns the position in ``order`` to search from next.

        The caller marks ``u`` busy (``active``/``in_backward``) first; that mark cannot change
        which units ``_use`` frees to make room, as it frees only gathered units and ``u`` is
        gathered only after that choice."""
        if recording is not None:
            recording.append(u.index)
        self._use(u)
        self._event(event, u)
        at = self._advance(order, pos, u.index)
        if at is None or recording is not None:
            return pos
        self._prefetch(order, at + 1)
        return at + 1

    @staticmethod
    def _advance(order: list[int] | None, pos: int, index: int) -> int | None:
        """Where ``index`` next occurs in ``order`` at or after ``pos`` (None: not expected)."""
        if order is None:
            return None
        try:
            return order.index(index, pos)
        except ValueError:
            return None

    # ------------------------------------------------------------------ the scope
    def enter_scope(self) -> bool:
        """Returns True for the outermost forward (the caller then starts its touch mode)."""
        self._depth += 1
        if self._depth > 1:
            return False
        self._fwd_pos = 0
        if torch.is_grad_enabled():
            if not self._step_open:
                self.kept = set()
            self._step_open = True
            if self.fwd_order is None and self._recording_fwd is None:
                self._recording_fwd = []
        self._use(self.root)
        self._event("scope", self.root)
        if self._recording_fwd is None:  # the first units' gathers overlap the embedding's work
            self._prefetch(self.fwd_order, 0)
        return True

    def exit_scope(self) -> bool:
        """Returns True when the outermost forward ends."""
        self._depth -= 1
        if self._depth > 0:
            return False
        if self._recording_fwd is not None:
            self.fwd_order, self._recording_fwd = self._recording_fwd, None
        if not self._step_open:  # no backward will follow: free everything now
            self.free_all()
        return True

    # ------------------------------------------------------------------ forward
    @staticmethod
    def recomputing(u: Unit) -> bool:
        """Whether a forward of ``u`` starting now is the recomputation of one whose backward is
        running (``torch.utils.checkpoint(..., use_reentrant=False)`` around the unit, or around
        a region holding it, in the user's model): it runs inside an autograd pass while that
        forward's post-backward is still pending. Its graph is never backpropagated: autograd only
        takes the tensors it saves - views of the unit's gathered buffer - for the running
        backward. (A reentrant checkpoint's recomputation follows a ``no_grad`` forward, so
        nothing is pending: its graph is backpropagated and routed as usual.)"""
        return u.pending_backward > 0 and torch._C._current_graph_task_id() != -1

    def pre_forward(self, u: Unit) -> None:
        u.active += 1
        if torch._C._current_graph_task_id() != -1:  # a recomputation in backward: no forward order
            self._use(u)
            self._event("recompute_forward", u)
            return
        self._fwd_pos = self._enter(u, "forward", self._recording_fwd, self.fwd_order,
                                    self._fwd_pos)

    def post_forward(self, u: Unit) -> None:
        u.active -= 1
        self._event("forward_done", u)
        if torch._C._current_graph_task_id() != -1:
            # a recomputation in backward: the values it saved are read by the backward that
            # follows at once; its post-backward (or after_backward) frees the unit
            return
        if u.active == 0 and not u.pinned and u is not self.root:
            if not torch.is_grad_enabled():
                self._free(u)
            elif self.options.reshard_after_forward:
                if self._keeps(u):
                    self.kept.add(u.index)
                else:
                    self._free(u)

    def _keeps(self, u: Unit) -> bool:
        """Whether ``u`` stays gathered after its forward (``max_reuse_distance``): its reuse
        distance is within the bound and the gathered units fit ``max_live_parameters``."""
        bound = self.options.max_reuse_distance
        if bound <= 0 or self.fwd_order is None or self.bwd_order is None:
            return False
        if self._reuse is None:
            self._reuse = reuse_distances(self.units, self.fwd_order, self.bwd_order)
        return self._reuse.get(u.index, bound + 1) <= bound and self.live <= self.options.max_live_parameters

    def ensure_gathered(self, u: Unit) -> None:
        """Before a checkpointed forward runs: in forward the unit is gathered already; in the
        recomputation during backward (outside any forward of it) it is gathered again if
        its pre-backward did not already do so."""
        if u.active == 0:
            self._event("recompute", u)
        if u.state is not ShardState.UNSHARDED:
            self._event("recompute_gather", u)
        self._use(u)

    # ------------------------------------------------------------------ backward
    def before_backward(self) -> None:
        self._bwd_pos = 0
        self._backward = True
        if self.bwd_order is None:
            self._recording_bwd = []
        else:  # the last units' gathers overlap the loss's and the head's backward
            self._prefetch(self.bwd_order, 0)

    def pre_backward(self, u: Unit) -> None:
        u.in_backward = True
        self._bwd_pos = self._enter(u, "backward", self._recording_bwd, self.bwd_order,
                                    self._bwd_pos)

    def post_backward(self, u: Unit) -> None:
        u.pending_backward -= 1
        self._event("backward_done", u)
        if u.pending_backward > 0 or u.pinned:
            return
        u.in_backward = False
        if u.has_grads():
            u.reduce_grads(self.options.reduce_mode, self.pool, self.queue, self.group,
                           in_full=self._reduce_in_full(u))
        self._free(u)

    def _reduce_in_full(self, u: Unit) -> bool:
        """Whether ``u``'s gradients can be gathered into its own gathered buffer (its backward
        is done with the values): the same dtype as the reduction's, and a buffer of its own
        (not offload's file mapping that is the master itself)."""
        return (not u.persistent and u.full.dtype == self.pool.dtype and u.state is ShardState.UNSHARDED
                and not getattr(u, "mapped_full", False))

    def after_backward(self, sync: bool) -> None:
        """End of ``loss.backward()``: reduce what is left, wait for every reduction, free all.
        Every micro-batch is reduced (as ZeRO-2), so ``sync`` changes nothing."""
        for u in self.units:  # index order: the same on every rank
            if u.has_grads():
                u.reduce_grads(self.options.reduce_mode, self.pool, self.queue, self.group)
        self.queue.wait(Work.BUCKETS)  # the reductions; gathers still in flight land in free_all
        self.pool.clear()  # between steps a rank holds its shards and nothing else
        if self._recording_bwd is not None:
            self.bwd_order, self._recording_bwd = self._recording_bwd, None
        self._step_open = self._backward = False
        self.free_all()

    def free_all(self) -> None:
        """Free every gathered unit (waiting for gathers in flight) and reset per-step state (hpZ's
        node copies too: the step will change the values)."""
        for u in self.units:
            self._free(u)
            u.pending_backward = 0
            u.pinned = u.in_backward = False
            u.drop_secondary()

    # ------------------------------------------------------------------ outside a unit's forward
    def touched(self, params: list) -> None:
        """Parameters of sharded units were used outside their unit's forward: gather those
        units now and keep them until the end of the step (their backward may need them)."""
        for p in params:
            u = self.owner[id(p)]
            if u.state is ShardState.UNSHARDED:
                continue
            if u.index not in self._warned:
                self._warned.add(u.index)
                log.warning("zero3: a parameter of unit %r (shape %s) was used outside that unit's "
                            "forward; it is gathered on demand and kept until the end of the step. "
                            "If this is regular, make the unit enclose the use (unit_modules) or "
                            "tie the parameter to a module that runs there.", u.name, tuple(p.shape))
            self._event("on_demand", u)
            self._use(u)
            u.pinned = True

    def hold(self, units: Sequence[Unit]) -> None:
        """Gather ``units`` for reading outside any step (``ZeroStage3.gathered``)."""
        for u in units:
            self._use(u)
            u.pinned = True

    # ------------------------------------------------------------------ GradientShards
    def partitions(self) -> list[torch.Tensor]:
        return list(self.grad_views)

    def zero(self, slots: list[int] | None = None) -> None:
        """Zero every unit's gradient partition, or only the optimizer runs ``slots`` (indices
        of ``grad_views``: one optimizer's; the others accumulate on)."""
        if slots is not None:
            for i in slots:
                self.grad_views[i].zero_()
            return
        for u in self.units:
            u.grad.zero_()
            u.grad_clean = True

    def persistent(self) -> list[torch.Tensor]:
        return [u.grad for u in self.units]

    def _quant_pools(self) -> list[SizedPool]:
        """ZeRO++'s pools of int8 buffers, each once (the units normally share one)."""
        return list({id(u.quant.pool): u.quant.pool for u in self.units}.values())

    def comm_buffers(self) -> list[torch.Tensor]:
        return list(self.pool.buffers) + [t for p in self._quant_pools() for t in p.buffers()]

    def open(self) -> None:
        """Nothing: ``close()`` frees units and buffers, which come back on demand; the hooks are
        the strategy's and stay."""

    def close(self) -> None:
        self.queue.wait_all()
        self.free_all()
        self.pool.clear()
        for p in self._quant_pools():
            p.clear()


def reuse_distances(units: Sequence[Unit], fwd_order: list[int], bwd_order: list[int]) -> dict[int, int]:
    """Per unit, the elements of the other (non-root, non-persistent) units gathered between its
    last forward and its first backward in the recorded orders: ``max_reuse_distance``'s measure.
    A unit the backward does not reach gets none (never kept)."""
    size = {u.index: (0 if u.persistent or u is units[0] else u.numel) for u in units}
    out: dict[int, int] = {}
    for index in set(fwd_order):
        if index not in bwd_order:
            continue
        after = fwd_order[len(fwd_order) - fwd_order[::-1].index(index):]
        before = bwd_order[:bwd_order.index(index)]
        out[index] = sum(size[i] for i in set(after) | set(before) if i != index)
    return out
