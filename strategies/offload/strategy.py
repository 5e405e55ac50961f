"""The ``offload`` strategy: a ZeRO stage whose fp32 master weights and optimizer state live in
host RAM or on NVMe, stepped sub-group by sub-group by the fused CPU Adam kernel.

Composition, not flags: ``Offload(stage=2, ...)`` builds an :class:`OffloadZeroStage2`, whose
bases are ``(Offload, ZeroStage2)``; ``stage=3`` an :class:`OffloadZeroStage3`. The stage keeps
everything it owns (working parameters, gradient reduction into partitions, gathering, checkpoint
layout); :class:`Offload` replaces only the optimizer piece and the step around it:

    setup_optimizer: the stage lays out working params, fp32 master *slots* (ZeRO-2: one per param
                     group; ZeRO-3: one per run of a unit) and gradient partitions; Offload keeps
                     the masters on the host (or writes them to swap files), allocates or swaps the
                     Adam state and plans the sub-groups
    optimizer_step:  ``Strategy.optimizer_step`` with these pieces: unscale + overflow check
                     (fp16) -> global grad norm (one all-reduce; the clip coefficient is *not*
                     applied to the gradients but folded into the kernel's ``grad_scale``) -> for
                     each sub-group: [read its state from disk] -> fused Adam writing master,
                     state and the bf16/fp16 working copy in one pass -> [write the state back]
                     -> the stage refreshes the working parameters (ZeRO-2: all-gather of the
                     partitions; ZeRO-3: nothing until the next use)

One constructor with simple typed keywords (the Hydra schema ``base_offload`` is generated from it):
the offload policy (:class:`~.config.OffloadConfig`), then the stage options, each passed to the
stage that has it (``unit_modules`` is a comma-separated list of class names here).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
import weakref
from typing import Any, Optional

import torch

from ..zero.config import BUCKET_NUMEL
from ..zero.estimate import format_bytes
from ..zero.sharded_optimizer import ShardedOptimizer
from ..zero.stage2 import ZeroStage2
from ..zero.stage3 import ZeroStage3
from ..zero.strategy import ZeroStrategy
from .aio import AsyncFileIO, DirectIOProbe, probe_direct_io
from .config import OffloadConfig
from .optimizer import OffloadedAdam, TorchOffload, fused_path_refusal
from .param_swap import ShardPager, swap_unit_to_files
from .plan import plan_subgroups
from .swapper import SwappedStates
from .transfer import DeviceWorking, HostWorking

log = logging.getLogger("zerotrain")


class Offload(ZeroStrategy):
    """A ZeRO stage with the optimizer offloaded; see the module docstring."""

    name = "offload"
    _stage_base: type = ZeroStrategy  # the composed classes name their stage

    def __new__(cls, *args: Any, **kwargs: Any) -> "Offload":
        if cls is Offload:  # pick the composed class for the requested stage
            stage = kwargs.get("stage", args[0] if args else 2)
            cls = _STAGE_CLASSES.get(stage, Offload) if not isinstance(stage, bool) else Offload
        return super().__new__(cls)

    def __init__(self, stage: int = 2, optimizer_device: str = "cpu", param_device: str = "none",
                 nvme_path: Optional[str] = None, pin_memory: bool = True, buffer_count: int = 4,
                 sub_group_size: int = 10_000_000, io_threads: int = 2, io_block_size: int = 8 << 20,
                 direct_io: bool = True,
                 # options of both stages
                 reduce_dtype: str = "fp32", reduce_mode: str = "auto", overlap_comm: bool = True,
                 partition_alignment: int = 1, process_group_timeout_s: float = 300.0,
                 # ZeRO-2 options
                 reduce_bucket_size: int = BUCKET_NUMEL, allgather_bucket_size: int = BUCKET_NUMEL,
                 contiguous_gradients: bool = True,
                 # ZeRO-3 options
                 unit_modules: Optional[str] = None, reshard_after_forward: bool = True,
                 prefetch_bucket_size: int = 50_000_000, max_live_parameters: int = 1_000_000_000,
                 param_persistence_threshold: int = 0, activation_checkpointing: bool = False) -> None:
        """The offload policy's fields are documented on :class:`~.config.OffloadConfig`; the stage
        options on ``ZeroConfig`` / ``Stage3Config``. Setting an option the chosen stage does not
        have is an error (``unit_modules``: comma-separated module class names)."""
        given = {k: v for k, v in locals().items() if k in _STAGE_OPTIONS}
        self.offload = OffloadConfig(stage, optimizer_device, param_device, nvme_path, pin_memory,
                                     buffer_count, sub_group_size, io_threads, io_block_size, direct_io)
        accepted = inspect.signature(self._stage_base.__init__).parameters
        for k, v in given.items():
            if k not in accepted and v != _STAGE_OPTIONS[k]:
                raise ValueError(f"Offload: {k}={v!r} is not an option of stage={stage} "
                                 f"({self._stage_base.__name__}); leave it at its default "
                                 f"{_STAGE_OPTIONS[k]!r}")
        kwargs = {k: v for k, v in given.items() if k in accepted}
        if isinstance(kwargs.get("unit_modules"), str):
            kwargs["unit_modules"] = [n.strip() for n in kwargs["unit_modules"].split(",") if n.strip()]
        super().__init__(**kwargs)
        self.transfer: HostWorking | DeviceWorking | None = None
        self.io: AsyncFileIO | None = None
        self.direct_io = DirectIOProbe(False, "no swap files")  # what set-up detected
        self._clip_coef = 1.0

    # ------------------------------------------------------------------ what a stage provides
    def _slot_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(reduced gradient, working values) of each master slot, in ``self.sharded.masters``
        order."""
        raise NotImplementedError

    def _masters_stay_in_ram(self, masters: list[torch.Tensor], working: list[torch.Tensor]) -> bool:
        """True when something else needs the fp32 masters in RAM (then only Adam's moments are
        swapped): the working params are the masters (fp32), or the stage owns them."""
        return all(m.data_ptr() == w.data_ptr() for m, w in zip(masters, working) if m.numel())

    # ------------------------------------------------------------------ set-up
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        cfg = self.offload
        refusal = fused_path_refusal(optimizer)
        if refusal and cfg.optimizer_device == "nvme":
            raise ValueError(
                f"Offload: optimizer_device='nvme' swaps Adam state only, and {refusal}. Use "
                "torch.optim.Adam/AdamW or zerotrain.ops.CPUAdam, or optimizer_device='cpu' (which "
                "steps any element-wise optimizer on the host)")
        on_gpu = self.device.type == "cuda"
        if on_gpu and (self.stage == 3 or cfg.param_device != "none"):
            raise ValueError(f"Offload: stage={self.stage} with param_device={cfg.param_device!r} on a "
                             "CUDA device is not built; use stage=2 with param_device='none' on GPUs")
        super().setup_optimizer(optimizer)  # the stage: working params, master slots, gradients
        masters = list(self.sharded.masters)
        if on_gpu:  # host copies; the stage's device masters are dropped below
            masters = [m.to("cpu").pin_memory() if cfg.pin_memory else m.to("cpu") for m in masters]
        grads, working = self._slot_views()
        if on_gpu:
            self.transfer = DeviceWorking(working, grads, cfg.pin_memory)
            self.grads.on_reduced = self._stream_grad
        else:
            self.transfer = HostWorking(working, grads)
        subgroups = plan_subgroups([m.numel() for m in masters], cfg.sub_group_size)
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        it = iter(masters)
        for group, n in zip(optimizer.param_groups, sizes):  # host masters, group by group
            group["params"] = [next(it) for _ in range(n)]
        if refusal:
            log.info("offload: %s; stepping it with the optimizer itself on host fp32 masters", refusal)
            if on_gpu:
                it = iter(masters)
                optimizer.state.clear()
                self.sharded = ShardedOptimizer(optimizer, [[next(it) for _ in range(n)] for n in sizes])
            self.sharded = TorchOffload(self.sharded, self.transfer, subgroups)
        else:
            swapped = None
            if cfg.optimizer_device == "nvme":
                external = masters if not on_gpu and self._masters_stay_in_ram(masters, working) else None
                swapped = self._swapper(subgroups, external)
            self.sharded = OffloadedAdam(optimizer, subgroups, self.transfer, swapped)
        self._after_optimizer_setup(subgroups)
        self._log_offload()

    def _after_optimizer_setup(self, subgroups) -> None:
        pass

    def _swapper(self, subgroups, external) -> SwappedStates:
        cfg = self.offload
        os.makedirs(cfg.nvme_path, exist_ok=True)
        self.direct_io = probe_direct_io(cfg.nvme_path) if cfg.direct_io else \
            DirectIOProbe(False, "direct_io=False")
        self.io = AsyncFileIO(cfg.io_threads, cfg.io_block_size)
        swapped = SwappedStates(cfg.nvme_path, subgroups, cfg.buffer_count, self.io,
                                self.direct_io.supported, pin=cfg.pin_memory and self.device.type == "cuda",
                                rank=self.global_rank, external_master=external)
        # scratch files go when the strategy is collected or the process exits (not at teardown:
        # full_state_dict() may follow fit())
        weakref.finalize(self, _close_quietly, swapped, self.io)
        return swapped

    def _stream_grad(self, slot: int, start: int, numel: int) -> None:
        if self._sync:  # inside no_sync() the partition is still accumulating
            self.transfer.stream_grad(slot, start, numel)

    @contextlib.contextmanager
    def no_sync(self):
        """Every micro-batch is reduced (ZeRO-2/3); this only tells the GPU path which backward's
        gradients are final (those are streamed to the host)."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    # ------------------------------------------------------------------ pieces of the step
    # (the sequence is Strategy.optimizer_step; the stage supplies the rest)
    def step_gradients(self) -> list[torch.Tensor]:
        """The reduced gradient of each slot, in the stage's reduce dtype, on its device."""
        return self.grads.partitions()

    def _local_grad_sq_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in self.step_gradients():
            for chunk in g.split(self.offload.sub_group_size):
                c = chunk.float()
                sq += torch.dot(c, c)
        return sq * self._clip_coef ** 2

    def _scale_grads(self, coef: torch.Tensor) -> None:
        """The clip coefficient is folded into the next step's kernel (``grad_scale``) instead of
        rewriting the gradients in place."""
        self._clip_coef *= float(coef)

    def _inner_step(self, loss_scale: float) -> None:
        """The host stepper, given one gradient multiplier: the clip coefficient, divided by the
        loss scale the host gradient copies still carry (the transfer says which: the GPU path
        copies them during backward, before the plugin unscaled the device partitions)."""
        self.sharded.step(grad_scale=self._clip_coef / self.transfer.host_grad_scale(loss_scale))

    def zero_grad(self) -> None:
        self._clip_coef = 1.0
        self.grads.zero()

    # ------------------------------------------------------------------ memory and end
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = super().memory_tensors()
        out["master"] = self.sharded.master_tensors() if self.sharded else []
        out["comm_buffers"] += self.transfer.buffers() if self.transfer else []
        return out

    def offload_report(self) -> dict[str, Any]:
        """Where the optimizer state is, and how it moves (for logs and tests)."""
        states = getattr(self.sharded, "states", None)
        swapped = isinstance(states, SwappedStates)
        return {"stage": self.stage, "optimizer_device": self.offload.optimizer_device,
                "param_device": self.offload.param_device,
                "fused_adam": isinstance(self.sharded, OffloadedAdam),
                "subgroups": len(getattr(self.sharded, "subgroups", [])),
                "swapped_kinds": list(states.kinds) if swapped else [],
                "io_mode": self.direct_io.mode if swapped else None,
                "io_reason": self.direct_io.reason if swapped else None,
                "disk_bytes": states.disk_bytes() if swapped else 0,
                "swap_dir": states.directory if swapped else None,
                "bytes_read": self.io.bytes_read if self.io else 0,
                "bytes_written": self.io.bytes_written if self.io else 0}

    def _log_memory(self, when: str) -> None:
        pass  # the stage's formula does not hold with offload; _log_offload says what is where

    def _log_offload(self) -> None:
        if not self.is_global_zero:
            return
        rep = self.offload_report()
        where = (f"swap files ({'+'.join(rep['swapped_kinds'])}) in {rep['swap_dir']} "
                 f"({format_bytes(rep['disk_bytes'])}, {rep['io_mode']}: {rep['io_reason']})"
                 if rep["io_mode"] else "host RAM")
        log.info("offload: stage %d, optimizer state in %s, %d sub-groups of <= %d elements, %s", self.stage,
                 where, rep["subgroups"], self.offload.sub_group_size,
                 "fused Adam" if rep["fused_adam"] else "the optimizer's own step")

    def teardown(self) -> None:
        """Stops the I/O threads. Swap files stay until the strategy is garbage-collected (or the
        process exits): the Trainer tears down at the end of ``fit`` and ``full_state_dict()`` or a
        checkpoint (``param_shards()``) may still follow, reading the state back (threads restart
        on demand)."""
        if self.io is not None:
            self.io.close()
        super().teardown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, {self.offload.as_dict()}, {self.config.as_dict()})"


def _close_quietly(*objs: Any) -> None:
    for obj in objs:
        with contextlib.suppress(Exception):
            obj.close()


#: every stage option of Offload's constructor, with its default
_STAGE_OPTIONS = {k: p.default for k, p in inspect.signature(Offload.__init__).parameters.items()
                  if k not in ("self", *OffloadConfig.__dataclass_fields__)}


class OffloadZeroStage2(Offload, ZeroStage2):
    """ZeRO-2 gradients (reduced into partitions during backward) + offloaded optimizer."""

    _stage_base = ZeroStage2

    def _slot_views(self):
        return self.grads.partitions(), [fg.partition(self.global_rank) for fg in self.flat_groups]

    def _refresh_params(self) -> None:
        """All-gather the updated working partitions (the kernel already wrote them)."""
        for fg in self.flat_groups:
            fg.gather_from(fg.partition(self.global_rank), self.global_rank,
                           self.config.allgather_bucket_size, self.queue, self.group)


class OffloadZeroStage3(Offload, ZeroStage3):
    """ZeRO-3 (parameters gathered per unit) + offloaded optimizer, and with
    ``param_device="nvme"`` the units' shards in files (``param_swap``)."""

    _stage_base = ZeroStage3

    def setup_module(self, module) -> None:
        if self.offload.param_device == "nvme":
            os.makedirs(self.offload.nvme_path, exist_ok=True)
            self._param_dir = tempfile.mkdtemp(prefix=f"zerotrain-params-rank{self.global_rank}-",
                                               dir=self.offload.nvme_path)
            self._param_shards: list = []
            self._param_files = weakref.finalize(self, _remove_param_files, self._param_shards, self._param_dir)
        super().setup_module(module)

    def _build_unit(self, *args: Any, **kwargs: Any):
        """Each unit goes to its files as soon as it is built, so the whole model's shards are
        never in RAM together."""
        unit = super()._build_unit(*args, **kwargs)
        if self.offload.param_device == "nvme":
            swap_unit_to_files(unit, self._param_dir)
            self._param_shards.extend(getattr(unit, "shards", ()))
        return unit

    def _slot_views(self):
        grads = self.runtime.grad_views
        order = [(u, r) for g in range(len(self.optimizer.param_groups)) for u, r, _ in self._runs
                 if r.group == g]  # the masters' order: group by group
        return grads, [u.working[r.start:r.start + r.numel] for u, r in order]

    def _masters_stay_in_ram(self, masters, working) -> bool:
        return True  # the units own them (and with param_device="nvme" they are file-backed)

    def _after_optimizer_setup(self, subgroups) -> None:
        if self.offload.param_device == "nvme" and isinstance(self.sharded, OffloadedAdam):
            order = [(u, r.start) for g in range(len(self.optimizer.param_groups)) for u, r, _ in self._runs
                     if r.group == g]
            self.sharded.pager = ShardPager(subgroups, order)

    def _refresh_params(self) -> None:
        self.sharded.import_loaded_state()  # after ZeRO-3's own loads (optimizer.load_state_dict)
        super()._refresh_params()  # free units, refresh working shards, gather persistent ones

    def param_shards(self):
        with self.sharded.exposed_state():
            return super().param_shards()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """As ZeRO-3's, without the file-backed shards (``offload_report`` counts those)."""
        out = super().memory_tensors()
        mapped = {sh.tensor.untyped_storage().data_ptr() for u in self.units for sh in getattr(u, "shards", ())}
        for cat in ("params", "master"):
            out[cat] = [t for t in out[cat] if t.untyped_storage().data_ptr() not in mapped]
        return out

    def offload_report(self) -> dict[str, Any]:
        rep = super().offload_report()
        rep["param_dir"] = getattr(self, "_param_dir", None)
        rep["param_disk_bytes"] = sum(s.nbytes for u in self.units for s in getattr(u, "shards", ()))
        return rep


def _remove_param_files(shards, directory: str) -> None:
    _close_quietly(*shards)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


_STAGE_CLASSES: dict[int, type] = {2: OffloadZeroStage2, 3: OffloadZeroStage3}
