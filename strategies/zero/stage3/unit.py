"""One ZeRO-3 communication unit: the parameters gathered and freed together, their shards, and
the explicit state machine that moves them between sharded and gathered.

Storage (``P`` = this rank's partition of the unit's padded flat layout, see ``layout.py``):

* ``master``: fp32, ``P`` elements - the only persistent copy of the values; the optimizer steps on
  views of it (``unit_plan.optimizer_runs``);
* ``working``: the all-gather's input, ``P`` elements in the working dtype - the master itself in
  fp32, a copy refreshed after every step otherwise (offload's bf16 parameter files in fp32
  compute: a bf16 copy, gathered and upcast into ``full``, see :func:`cast_gather`);
* ``grad``: ``P`` elements in the reduction dtype, where reduced gradients accumulate;
* ``full``: the gathered flat buffer (all ranks' partitions side by side, the layout of
  ``all_gather_into_tensor``'s output). Its storage is resized to 0 bytes when sharded and back
  when gathered, so views of it that autograd saved in forward (``weight.t()`` in ``linear``)
  read the re-gathered values in backward, and the memory is really returned in between.

A parameter's ``.data`` is a view of ``full`` while the unit is UNSHARDED and a *placeholder*
otherwise: its shape and dtype, one NaN element of storage (``expand``). Shape queries keep
working (``configure_optimizers`` may sort parameters by ``dim()``), a stray read gives NaN and a
stray in-place write raises. Parameter objects never change, so ties and user references hold.

A gather in flight is an entry of the strategy's in-flight layer (``comm/inflight.py``) filed under the
unit itself; its ``on_done`` binds the parameters, so whoever waits for it (the unit when it is
used or resharded, teardown) completes GATHERING -> UNSHARDED.

A *persistent* unit (small parameters, ``param_persistence_threshold``) is gathered once and
stays UNSHARDED; after each step it is refreshed with one all-gather, like ZeRO-1/2's params.
"""
from __future__ import annotations

import enum
from typing import Callable, Sequence

import torch
from torch import nn

from ..comm.collectives import (BufferPool, all_gather_into, all_reduce_sum, gather_to, reduce_scatter_scratch,
                   reduce_scatter_sum)
from ..comm.inflight import InFlight, InFlightQueue, Work
from ..layout import GroupLayout
from ..comm.quantized import Quantization, exact_gather


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only this rank's partition exists; params are placeholders
    GATHERING = "gathering"  # an all-gather into ``full`` is in flight
    UNSHARDED = "unsharded"  # ``full`` holds every value; params are views of it


_PLACEHOLDERS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` backed by one shared NaN element (see the module docstring)."""
    key = (dtype, torch.device(device))
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.full((1,), float("nan"), dtype=dtype, device=device)
    base = _PLACEHOLDERS[key]
    return base.expand(shape) if len(shape) else base[0]


def is_placeholder(t: torch.Tensor) -> bool:
    base = _PLACEHOLDERS.get((t.dtype, t.device))
    return base is not None and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def cast_gather(full: torch.Tensor, mine: torch.Tensor, group: object = None):
    """The all-gather of shards kept in a lower dtype than the gathered values (offload's
    ``param_dtype="bf16"`` in fp32 compute): gathered in ``mine``'s dtype into a staging buffer,
    upcast into ``full`` when it lands (:meth:`Quantization.gather`'s shape)."""
    staged = torch.empty(full.numel(), dtype=mine.dtype, device=full.device)
    handles, keep, _ = exact_gather(staged, mine, group)

    def arrive() -> torch.Tensor:
        return full.copy_(staged)

    return handles, (*keep, staged), arrive


class Unit:
    #: a reduction in flight reads this unit's ``full`` (``reduce_grads(in_full=True)``)
    reducing_in_full = False
    #: an expert unit (moe/): its parameters are partitioned, gathered and reduced over its own
    #: expert-data-parallel group (``own_group``, ``layout`` sized to it, ``rank`` its index there)
    #: instead of the group the runtime passes, and its summed gradients are divided by
    #: ``divisor`` (the whole world), not by that group's size
    has_own_group = False
    own_group: object = None
    divisor: int | None = None

    def __init__(self, index: int, name: str, params: Sequence[nn.Parameter], names: Sequence[str],
                 layout: GroupLayout, rank: int, dtype: torch.dtype, reduce_dtype: torch.dtype,
                 device: torch.device, persistent: bool = False,
                 inflight: InFlightQueue | None = None, quant: Quantization = Quantization()) -> None:
        if len(params) != len(layout.spans):
            raise ValueError(f"unit {name!r}: {len(params)} parameters, layout has {len(layout.spans)}")
        # a unit with nothing to gather (an empty root) behaves as an always-gathered one
        persistent = persistent or layout.padded_numel == 0
        self.index, self.name, self.persistent = index, name, persistent
        self.params, self.names, self.layout, self.rank = list(params), list(names), layout, rank
        self.dtype, self.device = dtype, device
        #: ZeRO++: which of this unit's collectives go as block-wise int8 (``comm/quantized.py``)
        self.quant = quant
        lo, hi = layout.partition_range(rank)
        self.lo, self.hi = lo, hi
        make = torch.zeros if persistent else torch.empty
        self.full = make(layout.padded_numel, dtype=dtype, device=device)
        self._views = [self.full[s.offset:s.end].view(p.shape) for s, p in zip(layout.spans, params)]
        if persistent:
            self.working = self.full[lo:hi]
            self.master = self.working if dtype == torch.float32 else torch.zeros(hi - lo, device=device)
        else:
            self.master = torch.zeros(hi - lo, dtype=torch.float32, device=device)
            self.working = (self.master if dtype == torch.float32
                            else torch.zeros(hi - lo, dtype=dtype, device=device))
        self.grad = torch.zeros(hi - lo, dtype=reduce_dtype, device=device)
        #: ``grad`` is all zeros (made so, or zeroed by the runtime, and nothing reduced into it
        #: since): a reduce-scatter may then land in it directly (:meth:`reduce_grads`)
        self.grad_clean = True
        #: where reduced gradients go instead of ``grad`` (offload's ``grad_device="nvme"``):
        #: ``grad_sink(unit, reduced)`` with this rank's averaged partition; ``grad`` is then a
        #: meta tensor (its shape, no memory)
        self.grad_sink: Callable[[Unit, torch.Tensor], None] | None = None
        self.state = ShardState.UNSHARDED
        #: where this unit's collectives are filed and waited (the strategy's in-flight layer);
        #: its all-gather in flight is the entry filed under the unit itself
        self.inflight = inflight if inflight is not None else InFlightQueue()
        if persistent:
            self._bind()
        else:
            self._unbind()
            self._free()
            self.state = ShardState.SHARDED
        #: hpZ (``hierarchical_partition``): this rank's slice of the node's copy of the gathered
        #: values, taken when a gather lands; while ``secondary_valid`` (from the forward gather to
        #: the end of backward) backward gathers read it over the node group only. Its memory is
        #: held only then
        self.secondary: torch.Tensor | None = None
        self.secondary_valid = False
        self.node_group: object = None
        self._secondary_range = (0, 0)
        # per-step bookkeeping, owned by the runtime
        self.active = 0  # forwards of this unit currently running (nested or re-entrant calls)
        self.pending_backward = 0  # forwards whose backward has not reached the unit's inputs yet
        self.pinned = False  # gathered on demand for a use outside its forward: kept until the end
        self.prefetched = False  # gathered ahead of use and not used yet
        self.in_backward = False  # between its pre-backward and its post-backward

    def use_group(self, group: object, divisor: int) -> None:
        """Make this an expert unit communicating over ``group`` (see the class attributes)."""
        self.has_own_group, self.own_group, self.divisor = True, group, divisor

    def comm_group(self, group: object) -> object:
        return self.own_group if self.has_own_group else group

    # ------------------------------------------------------------------ sizes
    @property
    def numel(self) -> int:
        """Elements a gathered copy holds (padded): what counts against ``max_live_parameters``."""
        return self.layout.padded_numel

    @property
    def gathered(self) -> bool:
        return self.state is not ShardState.SHARDED

    # ------------------------------------------------------------------ transitions
    def enable_secondary(self, local_rank: int, local_world: int, node_group: object) -> None:
        """hpZ: keep a node-local copy of the gathered values, 1/``local_world`` of them per rank
        (``local_rank``'s slice), gathered back within ``node_group``."""
        if self.persistent:
            return
        size = self.layout.padded_numel // local_world
        self.secondary = torch.empty(size, dtype=self.dtype, device=self.device)
        self._secondary_range = (local_rank * size, (local_rank + 1) * size)
        self.node_group = node_group
        self.drop_secondary()

    def drop_secondary(self) -> None:
        """The node copy is stale (the step changes the values): mark it so and return its memory
        (like ``full``, its storage is resized to 0 bytes until the next forward gather)."""
        self.secondary_valid = False
        if self.secondary is not None:
            self.secondary.untyped_storage().resize_(0)

    def unshard_async(self, group: object = None, secondary: bool = False) -> bool:
        """SHARDED -> GATHERING: launch the all-gather into ``full``; False when not SHARDED.
        ``secondary``: from the node's copy (hpZ) when it holds this step's values."""
        if self.state is not ShardState.SHARDED:
            return False
        group = self.comm_group(group)
        if self.reducing_in_full:  # the last backward's reduction still reads ``full``
            self.inflight.wait(Work.BUCKETS)
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        if secondary and self.secondary_valid:
            handles, keep, arrive = exact_gather(self.full, self.secondary, self.node_group)
        else:
            gather = self.quant.gather if self.quant.weights else \
                exact_gather if self.working.dtype == self.full.dtype else cast_gather
            handles, keep, arrive = gather(self.full, self.working, group)
        self.state = ShardState.GATHERING

        def landed() -> None:
            arrive()  # qwZ: dequantize into ``full``
            if self.secondary is not None and not self.secondary_valid:
                sec = self.secondary
                sec.untyped_storage().resize_(sec.numel() * sec.element_size())
                sec.copy_(self.full[slice(*self._secondary_range)])
                self.secondary_valid = True
            self._landed()

        self.inflight.push(InFlight(handles, keep, landed, f"zero3 gather {self.name or 'root'}"), self)
        return True

    def prefetch_async(self, group: object = None, secondary: bool = False) -> bool:
        """A gather ahead of use (the runtime's prefetch): ``unshard_async``. A unit whose gather
        would overlap nothing may do less (offload's file-backed units on one rank only start
        reading their file); returns whether it is gathering."""
        return self.unshard_async(group, secondary)

    def wait(self) -> None:
        """GATHERING -> UNSHARDED (idempotent otherwise): wait for the data, bind the params."""
        if self.state is ShardState.GATHERING:
            self.inflight.wait(self)

    def _landed(self) -> None:
        """The gather's ``on_done``: the data is in ``full``."""
        self._bind()
        self.state = ShardState.UNSHARDED

    def unshard(self, group: object = None) -> None:
        self.unshard_async(group)
        self.wait()

    def reshard(self) -> None:
        """-> SHARDED: params become placeholders and ``full``'s memory is returned (an all-gather
        in flight lands first). A persistent unit stays gathered."""
        if self.persistent or self.state is ShardState.SHARDED:
            return
        self.wait()
        self._unbind()
        self._free()
        self.state = ShardState.SHARDED
        self.prefetched = False

    def _bind(self) -> None:
        for p, v in zip(self.params, self._views):
            p.data = v

    def _unbind(self) -> None:
        for p in self.params:
            p.data = placeholder(p.shape, self.dtype, self.device)

    def _free(self) -> None:
        if not self.reducing_in_full:  # else the reduction's landing frees it
            self.full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ values
    def master_in_working(self) -> None:
        """16-bit masters (``ZeroConfig.master_dtype`` = the working dtype): the working partition
        is the master, stepped in place; the separate fp32 master is dropped. Before ``load_full``."""
        self.master = self.working

    def load_full(self, flat: torch.Tensor) -> None:
        """Take this rank's partition of the unit's full flat values (fp32 or working dtype, at
        least ``layout.numel`` elements) as master and working copy."""
        lo, hi = self.lo, min(self.hi, self.layout.numel)
        mine = max(0, hi - lo)
        if mine:
            self.master[:mine].copy_(flat[lo:hi])
        self.master[mine:].zero_()
        if self.persistent:
            self.full[:self.layout.numel].copy_(flat[:self.layout.numel])
        elif self.working is not self.master:
            self.working.copy_(self.master)

    def refresh(self, group: object = None, copy: bool = True) -> None:
        """Collective for a persistent unit: make the working values match the stepped master
        (``copy=False``: the step wrote them already, as offload's kernel does; only the
        persistent all-gather is left)."""
        self.drop_secondary()
        group = self.comm_group(group)
        if copy and self.working is not self.master:
            self.working.copy_(self.master)
        if self.persistent and self.layout.padded_numel:
            mine = self.working.clone()  # the all-gather's input must not alias its output
            self.inflight.complete(all_gather_into(self.full, mine, group), mine, label="zero3 refresh")

    def gather_master(self, dst: int, group: object = None) -> torch.Tensor | None:
        """Collective: the unit's flat master values (the masters' dtype) on ``dst`` (None elsewhere)."""
        group = self.comm_group(group)
        full = outs = None
        if self.rank == dst:
            full = torch.empty(self.layout.padded_numel, dtype=self.master.dtype, device=self.device)
            outs = [full[slice(*self.layout.partition_range(r))] for r in range(self.layout.world_size)]
        mine = self.master.detach().contiguous()
        self.inflight.complete(gather_to(mine, outs, dst, group), mine, label="zero3 gather masters")
        return full

    def param_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.offset:s.end].view(p.shape) for s, p in zip(self.layout.spans, self.params)]

    # ------------------------------------------------------------------ gradients
    def has_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def reduce_space(self, mode: str, group: object = None) -> int:
        """Elements :meth:`reduce_grads` takes from the pool beyond the flat gradient."""
        if mode != "reduce_scatter":
            return 0
        group = self.comm_group(group)
        return max(self.hi - self.lo, reduce_scatter_scratch(self.layout.padded_numel, group))

    def reduce_grads(self, mode: str, pool: BufferPool, queue: InFlightQueue, group: object = None,
                     in_full: bool = False) -> None:
        """Collective: sum every rank's gradients of this unit, keep my partition (averaged) and
        add it to ``grad``. The gradients are copied into a pooled flat buffer and ``p.grad`` is
        freed at once; the reduction is pushed to ``queue`` (it completes while backward goes on).
        ``mode``: ``all_reduce``, ``reduce_scatter`` (on gloo an all-to-all,
        ``comm.reduce_scatter_sum``) or ``quantized`` (qgZ: every rank's int8 copy of my
        partition through an all-to-all, summed here in fp32). A reduce-scatter whose scratch
        fits one partition (2 ranks on gloo, or none needed), and qgZ's fp32 sum, land in ``grad``
        itself while ``grad_clean``: the pool's tail is not touched and no add follows.
        ``in_full``: the gradients are gathered into ``full`` itself, whose values the unit's
        backward has finished with (ZeRO-3's post-backward, when the dtypes agree), instead of a
        pooled buffer: memory already touched, none taken. ``full``'s memory is then returned when
        the reduction lands (:meth:`_free` leaves it until then), and a gather of the unit waits
        for that first."""
        layout, world = self.layout, self.layout.world_size
        group = self.comm_group(group)
        n, part = layout.padded_numel, self.hi - self.lo
        # into ``grad`` itself while it is zeros: no pooled piece to land in, no add afterwards
        direct = (self.grad_clean and self.grad_sink is None and self.grad.dtype == pool.dtype
                  and (mode == "reduce_scatter" and reduce_scatter_scratch(n, group) <= part
                       or mode == "quantized" and self.grad.dtype == torch.float32))
        extra = 0 if direct else self.reduce_space(mode, group)
        if in_full:
            space = pool.acquire(extra) if extra else None
            flat, tail = self.full[:n], space
            self.reducing_in_full = True
        else:
            space = pool.acquire(n + extra)
            flat, tail = space[:n], space[n:]
        for p, span in zip(self.params, layout.spans):
            dst = flat[span.offset:span.end]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
                p.grad = None
        flat[layout.numel:].zero_()
        keep: tuple[torch.Tensor, ...] = ()
        mine = summed = None  # summed: qgZ's work that sums my partition on arrival
        if direct and mode == "reduce_scatter":
            mine = self.grad
            handles = (reduce_scatter_sum(mine, flat, group, scratch=mine),)
        elif mode == "all_reduce":
            handles, mine = (all_reduce_sum(flat, group),), flat[self.lo:self.hi]
        elif mode == "reduce_scatter":
            mine = tail[:part]  # gloo: the all-to-all lands from here on, summed into mine
            handles = (reduce_scatter_sum(mine, flat, group, scratch=tail),)
        elif mode == "quantized":
            pieces = [(lo, hi - lo) for lo, hi in map(layout.partition_range, range(world))]
            handles, keep, summed = self.quant.reduce(flat, pieces, self.rank, group,
                                                      out=self.grad if direct else None)
        else:
            raise ValueError(f"reduce mode {mode!r}; valid choices: all_reduce, reduce_scatter, quantized")
        self.grad_clean = False

        def add_mine() -> None:
            reduced = (mine if summed is None else summed()).div_(self.divisor or world)
            if self.grad_sink is not None:
                self.grad_sink(self, reduced)
            elif not direct:  # direct: the sum landed in ``grad`` itself
                self.grad.add_(reduced)
            if space is not None:
                pool.release(space)
            if in_full:
                self.reducing_in_full = False
                if self.state is ShardState.SHARDED:
                    self._free()

        buffers = (flat,) + ((space,) if space is not None else ()) + tuple(keep)
        queue.push(InFlight(handles, buffers, add_mine, f"zero3 reduce {self.name or 'root'}"))

    # ------------------------------------------------------------------ memory
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = [self.working, self.full] + ([self.secondary] if self.secondary is not None else [])
        return {"params": params, "master": [self.master], "grads": [self.grad]}

    def __repr__(self) -> str:
        return (f"Unit({self.index}, {self.name or 'root'!r}, {len(self.params)} params, "
                f"{self.layout.numel} elements, {self.state.value})")
