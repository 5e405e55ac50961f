"""Partitioned construction: build the model in ``configure_model()`` without ever holding it
whole, and get exactly the weights an unpartitioned build with the same seed would have.

While ``TrainModule.configure_model()`` runs inside :class:`PartitionedBuild`:

1. ``nn.Module.register_parameter`` is wrapped: the moment a module registers a floating-point
   parameter, the parameter is cut into ``world_size`` equal chunks, this rank keeps its chunk
   and the parameter's ``.data`` becomes a placeholder (its shape, no storage - what a meta tensor
   would be, but a CPU tensor that still works with the code below). A parameter registered again
   (``lm_head.weight = wte.weight``) keeps its partition: ties survive.
2. The model's own initialisation code runs as in an eager build - ``reset_parameters()`` inside
   each layer's constructor, a final ``init_weights()`` / HF ``post_init()``, whatever the model
   does. A :class:`~.touch.ParamTouchMode` sees every op on a partitioned parameter and *opens* it
   first: the parameter gets a real full-size buffer, all-gathered from the chunks unless the op
   overwrites it entirely (``normal_``, ``kaiming_uniform_``, ``zeros_`` ...). Open parameters
   stay open while later ops touch others (so ``a[0].copy_(b[0])`` works), until together they
   exceed twice the largest parameter: then the least recently touched are *closed* - each rank
   keeps its chunk of the new values and the buffer is freed. So the random draws happen in the
   eager order, on tensors of the eager shapes: the weights are identical to an eager build, bit
   for bit, for any model (the demo GPT, torch layers, HF models), and the global RNG ends in the
   same state.
3. Afterwards the strategy lays the parameters out in units and moves each unit's values from
   these per-parameter chunks into its unit partition (``take``), one unit at a time.

Memory: at any moment a rank holds at most twice its largest parameter whole, plus during step 3
one unit's flat values, plus its chunks: 1/world_size of the model, the whole model on one rank.
Where the chunks live is the ``chunks`` store's choice: RAM (:class:`RamChunks`), or files that
hold them out of RAM between writes (offload's ``param_device="nvme"``,
``param_swap.FileChunks``), so a model larger than RAM is built on one rank. Every rank runs the same construction code, so the open/close decisions
and the all-gathers line up.

What a model must do: build its parameters inside ``configure_model()`` with plain torch ops (not
on the meta device), and not keep a view of a parameter's values for long while initialising many
other parameters (once closed, such a view points at a freed buffer). Buffers are built eagerly,
as usual: they are small and replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm.collectives import all_gather_into
from ..comm.inflight import InFlightQueue
from .touch import ParamTouchMode, is_overwrite
from .unit import placeholder


class RamChunks:
    """Where :class:`PartitionedBuild` keeps this rank's chunks by default: RAM. ``new`` makes a
    zeroed chunk; ``settle`` is told when one was written or read (a store may drop it from RAM
    until the next use)."""

    def new(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    def settle(self, chunk: torch.Tensor) -> None:
        pass


@dataclass
class Provisional:
    """One parameter while the model is being built: this rank's chunk of its flat values."""

    param: nn.Parameter
    numel: int
    chunk: int  # elements per rank; world_size * chunk >= numel
    shard: torch.Tensor


class PartitionedBuild:
    def __init__(self, rank: int, world_size: int, group: object = None,
                 inflight: InFlightQueue | None = None, chunks: RamChunks | None = None) -> None:
        self.rank, self.world, self.group = rank, world_size, group
        self.chunks = chunks if chunks is not None else RamChunks()
        self.inflight = inflight if inflight is not None else InFlightQueue()  # where gathers wait
        self.params: dict[int, Provisional] = {}
        self._open: dict[int, Provisional] = {}  # least recently touched first
        self._largest = 0
        self.mode = ParamTouchMode(self.params, self._on_touch)
        #: how many times a parameter was all-gathered for an op that reads it (tests read it)
        self.gathers = 0
        self._orig_register = None

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> "PartitionedBuild":
        orig = self._orig_register = nn.Module.register_parameter
        build = self

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            orig(module, name, param)
            if param is not None:
                build.adopt(param, f"{type(module).__name__}.{name}")

        nn.Module.register_parameter = register_parameter
        self.mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                with self.mode.silenced():
                    self._close_all()
        finally:
            self.mode.__exit__(exc_type, exc, tb)
            nn.Module.register_parameter = self._orig_register
        return False

    # ------------------------------------------------------------------ partitioning
    def adopt(self, p: nn.Parameter, where: str = "") -> None:
        """Partition ``p`` (its current values, whatever they are) and make it a placeholder."""
        if id(p) in self.params or not p.is_floating_point():
            return
        if p.device.type == "meta":
            raise ValueError(
                f"zero3: parameter {where} was created on the meta device inside configure_model(); "
                "zero3 builds the model partitioned itself and needs real values: create parameters "
                "on the CPU (the default) and let the strategy partition them")
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(f"zero3: {where} is a lazy (uninitialized) parameter; give the layer "
                             "its input size so the parameter exists at construction")
        with self.mode.silenced():
            n = p.numel()
            chunk = max(1, -(-n // self.world))
            shard = self.chunks.new(chunk, p.dtype, p.device)
            self._keep_chunk(p.detach().reshape(-1), shard, n, chunk)
            p.data = placeholder(p.shape, p.dtype, p.device)
            self.params[id(p)] = Provisional(p, n, chunk, shard)

    def _keep_chunk(self, flat: torch.Tensor, shard: torch.Tensor, n: int, chunk: int) -> None:
        lo, hi = self.rank * chunk, min(n, (self.rank + 1) * chunk)
        if hi > lo:
            shard[:hi - lo].copy_(flat[lo:hi])
        self.chunks.settle(shard)

    # ------------------------------------------------------------------ open / close
    def _on_touch(self, params: list, func: Any, args: tuple, kwargs: dict) -> None:
        with self.mode.silenced():
            for p in params:
                rec = self._open.pop(id(p), None)  # re-inserted last: most recently touched
                if rec is None:
                    rec = self.params[id(p)]
                    self._open_param(rec, gather=not is_overwrite(func, args, kwargs, p))
                self._open[id(p)] = rec
                self._largest = max(self._largest, rec.numel)
            touched = {id(p) for p in params}
            while sum(r.numel for r in self._open.values()) > 2 * self._largest:
                oldest = next((pid for pid in self._open if pid not in touched), None)
                if oldest is None:  # this one op touches more than that: all stay open for it
                    break
                self._close(self._open.pop(oldest))

    def _open_param(self, rec: Provisional, gather: bool) -> None:
        full = torch.empty(self.world * rec.chunk, dtype=rec.shard.dtype, device=rec.shard.device)
        if gather:
            self.gathers += 1
            self.inflight.complete(all_gather_into(full, rec.shard, self.group), label="open param")
            self.chunks.settle(rec.shard)
        rec.param.data = full[:rec.numel].view(rec.param.shape)

    def _close(self, rec: Provisional) -> None:
        p = rec.param
        if p.numel() != rec.numel:
            raise ValueError(f"zero3: a parameter of shape {tuple(p.shape)} changed its number of "
                             f"elements during construction (was {rec.numel}); replace the "
                             "Parameter instead of assigning a new .data")
        self._keep_chunk(p.detach().reshape(-1), rec.shard, rec.numel, rec.chunk)
        p.data = placeholder(p.shape, p.dtype, p.device)

    def _close_all(self) -> None:
        for rec in self._open.values():
            self._close(rec)
        self._open.clear()

    # ------------------------------------------------------------------ afterwards
    def owns(self, p: nn.Parameter) -> bool:
        return id(p) in self.params

    def take(self, p: nn.Parameter, out: torch.Tensor) -> None:
        """Collective: ``p``'s full flat values into ``out[:p.numel()]`` (the tail of ``out``
        up to ``world_size * chunk`` elements may be overwritten); ``p``'s chunk is then freed."""
        rec = self.params.pop(id(p))
        span = self.world * rec.chunk
        if out.dtype == rec.shard.dtype and out.numel() >= span and out.is_contiguous():
            self.inflight.complete(all_gather_into(out[:span], rec.shard, self.group), label="take param")
            return
        tmp = torch.empty(span, dtype=rec.shard.dtype, device=rec.shard.device)
        self.inflight.complete(all_gather_into(tmp, rec.shard, self.group), tmp, label="take param")
        out[:rec.numel].copy_(tmp[:rec.numel])

    def chunk_of(self, p: nn.Parameter) -> int:
        return self.params[id(p)].chunk

    def release(self) -> None:
        self.params.clear()
