"""The offload *stepper*: the optimizer part of a ZeRO strategy when fp32 master weights and
optimizer state live in host RAM or on NVMe (``OffloadPolicy``), stepped sub-group by sub-group by
the fused CPU Adam kernel. It is composed into the stage, not inherited: ``Offload(stage=3, ...)``
builds a ``ZeroStage3`` whose ``stepper`` is an :class:`OffloadStepper` (the default stepper,
:class:`~..zero.stepper.ShardedStepper`, steps the masters on the working device).

The stage keeps everything it owns (working parameters, gradient reduction into partitions,
gathering, checkpoint layout) and hands this part, at set-up, the *slots*: each master slice with
its reduced gradient and its working values. The part then

    set-up:  keeps the masters on the host (or writes them to swap files), allocates or swaps the
             Adam state and plans the sub-groups;
    a step:  unscale + overflow check (the precision plugin, on the device partitions) -> global
             grad norm (one all-reduce; the clip coefficient is *not* applied to the gradients but
             folded into the kernel's ``grad_scale``) -> for each sub-group: [read its state from
             disk] -> fused Adam writing master, state and the bf16/fp16 working copy in one pass
             -> [write the state back] -> the stage refreshes the working parameters from
             :meth:`updated` (ZeRO-2: all-gather of the working partitions; ZeRO-3: nothing until
             the next use).

With ``param_device="nvme"`` (ZeRO-3) it also places each unit's shards in files as the unit is
built (:meth:`place_unit`), so the whole model's shards are never in RAM together; with
``grad_device="nvme"`` each unit's reduced gradient goes to the swap files as it lands
(``grad_swap.py``), so the gradient partition is not in RAM either.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import weakref
from typing import Any, Callable, Sequence

import torch

from ..memory.formula import format_bytes
from ..zero.sharded_optimizer import ShardedOptimizer
from .aio import AsyncFileIO, DirectIOProbe, probe_direct_io
from .config import PARAM_DTYPES, STATE_DTYPES, OffloadPolicy
from ..zero.comm.grad_norm import slice_reader
from .grad_swap import SwappedGrads
from .optimizer import OffloadedAdam, TorchOffload, fused_path_refusal
from .param_swap import FileChunks, ShardPager, swap_unit_to_files
from .plan import plan_subgroups
from .swapper import SwappedStates
from .transfer import DeviceWorking, HostWorking

log = logging.getLogger("zerotrain")

#: the ZeRO stages offload composes with (stage 1 keeps full gradients: nothing to stream per slot)
STAGES = (2, 3)


def check_stage(stage: object) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"Offload: stage={stage!r}; valid choices: {', '.join(map(str, STAGES))}")


class OffloadStepper:
    """Steps the optimizer on host (or NVMe) fp32 masters; see the module docstring."""

    #: the strategy's name with this part
    name = "offload"
    #: the stage's memory formula does not hold (the masters and state are elsewhere)
    formula = False

    def __init__(self, policy: OffloadPolicy) -> None:
        self.policy = policy
        self.transfer: HostWorking | DeviceWorking | None = None
        self.io: AsyncFileIO | None = None
        self.direct_io = DirectIOProbe(False, "no swap files")  # what set-up detected
        self._clip_coef = 1.0
        self._low_master = False  # 16-bit masters (ZeroConfig.master_dtype): set at setup
        self._wrote_working = False  # the last step wrote the working shards (took_working)
        self._param_dir: str | None = None
        self._param_shards: list = []
        self._unit_order: list | None = None  # ZeRO-3: see page_units
        #: ``grad_device="nvme"``: the gradient partitions in the swap files (set up with the state)
        self.swapped_grads: SwappedGrads | None = None
        self._grad_slot: dict[int, int] = {}  # id() of a stage-side (meta) gradient -> its slot

    def check_stage(self, stage: int) -> None:
        """At construction: the policy fits the stage."""
        check_stage(stage)
        if self.policy.param_device != "none" and stage != 3:
            raise ValueError(f"Offload: param_device={self.policy.param_device!r} needs stage=3 (only "
                             f"ZeRO-3 partitions the parameters); got stage={stage}. Valid with "
                             f"stage={stage}: param_device='none'")
        if self.policy.grad_device != "cpu" and stage != 3:
            raise ValueError(f"Offload: grad_device={self.policy.grad_device!r} needs stage=3 (ZeRO-3 "
                             f"reduces each unit's gradient as its backward ends); got stage={stage}. "
                             f"Valid with stage={stage}: grad_device='cpu'")

    # ------------------------------------------------------------------ set-up
    def check(self, stage: int, device: torch.device, optimizer: torch.optim.Optimizer,
              precision: Any = None) -> None:
        """Before the stage lays anything out: refuse what this combination cannot do."""
        cfg = self.policy
        if cfg.grad_device == "nvme" and getattr(precision, "skips_nonfinite_steps", False):
            raise ValueError(f"Offload: grad_device='nvme' keeps no gradient in RAM, and precision "
                             f"{getattr(precision, 'name', precision)!r} unscales and checks the gradients "
                             f"there for overflow; valid: precision '32' or 'bf16-mixed', or grad_device='cpu'")
        working = getattr(precision, "param_dtype", torch.float32)
        if cfg.param_dtype != "auto" and working not in (torch.float32, PARAM_DTYPES[cfg.param_dtype]):
            raise ValueError(f"Offload: param_dtype={cfg.param_dtype!r} with precision "
                             f"{getattr(precision, 'name', precision)!r}, whose working parameters are {working}; "
                             f"valid: precision '32' (or 'bf16-mixed', where the shards are bf16 anyway), "
                             f"or param_dtype='auto'")
        refusal = fused_path_refusal(optimizer)
        if refusal and cfg.optimizer_device == "nvme":
            raise ValueError(
                f"Offload: optimizer_device='nvme' swaps Adam state only, and {refusal}. Use "
                "torch.optim.Adam/AdamW or zerotrain.ops.CPUAdam, or optimizer_device='cpu' (which "
                "steps any element-wise optimizer on the host)")
        if device.type == "cuda" and (stage == 3 or cfg.param_device != "none"):
            raise ValueError(f"Offload: stage={stage} with param_device={cfg.param_device!r} on a "
                             "CUDA device is not built; use stage=2 with param_device='none' on GPUs")

    def place_unit(self, unit: Any, rank: int) -> None:
        """ZeRO-3, as each unit is built: with ``param_device="nvme"`` its shards go to files;
        with ``grad_device="nvme"`` its gradient partition is no RAM buffer but a sink into the
        swap files (:meth:`_gradient_landed`)."""
        if self.policy.grad_device == "nvme":
            unit.grad = torch.empty(unit.grad.shape, dtype=unit.grad.dtype, device="meta")
            unit.grad_sink = self._gradient_landed
        if self.policy.param_device != "nvme":
            return
        low = PARAM_DTYPES[self.policy.param_dtype]
        if low is not None and not unit.persistent and unit.working is unit.master:
            # fp32 compute with bf16 shard files: a separate working shard, which the kernel
            # rewrites from the stepped master (param_out) and the gathers upcast (Unit.unshard_async)
            if unit.quant.weights:
                raise ValueError(f"Offload: param_dtype={self.policy.param_dtype!r} with quantize_weights=True "
                                 f"is not built; valid: one of them")
            unit.working = unit.master.to(low)
        swap_unit_to_files(unit, self._parameter_directory(rank))
        self._param_shards.extend(getattr(unit, "shards", ()))

    def build_chunks(self, rank: int) -> FileChunks | None:
        """ZeRO-3's partitioned build: with ``param_device="nvme"`` this rank's chunks are kept in
        files too (the whole model, on one rank), resident only while written or read."""
        if self.policy.param_device != "nvme":
            return None
        return FileChunks(self._parameter_directory(rank), self.policy.nvme_path)

    def _parameter_directory(self, rank: int) -> str:
        """This rank's folder for parameter files under ``nvme_path`` (made at first use,
        removed when this part is collected)."""
        if self._param_dir is None:
            os.makedirs(self.policy.nvme_path, exist_ok=True)
            self._param_dir = tempfile.mkdtemp(prefix=f"zerotrain-params-rank{rank}-", dir=self.policy.nvme_path)
            weakref.finalize(self, _remove_param_files, self._param_shards, self._param_dir)
        return self._param_dir

    def setup(self, sharded: ShardedOptimizer, slots: "Callable[[], tuple[list, list]]", device: torch.device, rank: int,
              masters_external: bool, on_reduced: "Callable[[Callable], None]",
              is_sync: Callable[[], bool]) -> OffloadedAdam | TorchOffload:
        """After the stage laid out its masters (``sharded``, on ``device``) and gradient partitions:
        returns what steps from now on. ``slots()``: (reduced gradient, working values) of each
        master slice in ``sharded.masters`` order; ``masters_external``: the stage owns the masters
        (ZeRO-3 units), so only Adam's moments may be swapped; ``on_reduced(fn)`` asks the stage's
        reducer to call ``fn(slot, start, numel)`` as each reduced piece lands (the GPU path
        streams it to the host)."""
        cfg, optimizer = self.policy, sharded.optimizer
        refusal = fused_path_refusal(optimizer)
        on_gpu = device.type == "cuda"
        masters = list(sharded.masters)
        if on_gpu:  # host copies; the stage's device masters are dropped below
            masters = [m.to("cpu").pin_memory() if cfg.pin_memory else m.to("cpu") for m in masters]
        grads, working = slots()
        self._low_master = any(m.dtype != torch.float32 for m in masters)
        if self._low_master and (on_gpu or any(g.dtype != m.dtype for g, m in zip(grads, masters))):
            raise ValueError(f"Offload: {masters[0].dtype} masters (master_dtype) are stepped on the host with "
                             f"gradients of their own type; valid: a CPU device and reduce_dtype equal to "
                             f"master_dtype (got {grads[0].dtype if grads else None})")
        if on_gpu:
            self.transfer = DeviceWorking(working, grads, cfg.pin_memory)
            on_reduced(lambda slot, start, numel: self.transfer.stream_grad(slot, start, numel)
                       if is_sync() else None)  # inside no_sync() the partition still accumulates
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
                sharded = ShardedOptimizer(optimizer, [[next(it) for _ in range(n)] for n in sizes])
            return TorchOffload(sharded, self.transfer, subgroups)
        swapped = None
        if cfg.optimizer_device == "nvme":
            same = all(m.data_ptr() == w.data_ptr() for m, w in zip(masters, working) if m.numel())
            external = masters if not on_gpu and (masters_external or same) else None
            grad_dtype = grads[0].dtype if cfg.grad_device == "nvme" and grads else None
            swapped = self._swapper(subgroups, external, rank, pin=cfg.pin_memory and on_gpu, grad_dtype=grad_dtype)
            if grad_dtype is not None:
                self.swapped_grads = SwappedGrads(swapped, subgroups, self._unit_order, self.io, cfg.grad_buffers)
                self._grad_slot = {id(g): i for i, g in enumerate(grads)}
        stepper = OffloadedAdam(optimizer, subgroups, self.transfer, swapped, self.swapped_grads)
        if self._param_dir is not None:
            if self.io is None:  # parameter files without swap files: threads for their write-backs
                self.io = AsyncFileIO(cfg.io_threads, cfg.io_block_size)
            stepper.pager = ShardPager(subgroups, self._unit_order, self.io)
        return stepper

    def _gradient_landed(self, unit: Any, reduced: torch.Tensor) -> None:
        """A unit's reduced gradient (``Unit.grad_sink``) with ``grad_device="nvme"``."""
        if self.swapped_grads is None:
            raise RuntimeError("Offload: a gradient was reduced before the optimizer was set up "
                               "(grad_device='nvme' writes it into the optimizer's swap files)")
        self.swapped_grads.accumulate(unit, reduced)

    def page_units(self, order: "Sequence[tuple[Any, int]]") -> None:
        """ZeRO-3: (unit, start) of each master slot, so the step can page each sub-group's unit
        shards in and out (``ShardPager``) and gradients find their sub-groups (``SwappedGrads``)."""
        self._unit_order = list(order)

    def _swapper(self, subgroups, external, rank: int, pin: bool, grad_dtype: torch.dtype | None) -> SwappedStates:
        cfg = self.policy
        os.makedirs(cfg.nvme_path, exist_ok=True)
        self.direct_io = probe_direct_io(cfg.nvme_path) if cfg.direct_io else \
            DirectIOProbe(False, "direct_io=False")
        self.io = AsyncFileIO(cfg.io_threads, cfg.io_block_size)
        swapped = SwappedStates(cfg.nvme_path, subgroups, cfg.buffer_count, self.io, self.direct_io.supported,
                                pin=pin, rank=rank, external_master=external,
                                state_dtype=STATE_DTYPES[cfg.optimizer_state_dtype], grad_dtype=grad_dtype)
        # scratch files go when this part is collected or the process exits (not at teardown:
        # full_state_dict() may follow fit())
        weakref.finalize(self, _close_quietly, swapped, self.io)
        return swapped

    # ------------------------------------------------------------------ pieces of the step
    def gradients(self, partitions: list[torch.Tensor], sharded: Any) -> list[torch.Tensor]:
        """The reduced gradient of each slot, in the stage's reduce dtype, on its device."""
        return partitions

    def norm_reader(self, grads: list[torch.Tensor]) -> Any:
        """Ranges of the gradient slots for the per-parameter norms: views, or with
        ``grad_device="nvme"`` streamed from the swap files (each sub-group read once)."""
        if self.swapped_grads is not None:
            return self.swapped_grads.read_ranges
        return slice_reader(grads)

    def norm_factor(self) -> float:
        """A clip coefficient already folded into the next step's kernel."""
        return self._clip_coef

    def scale(self, grads: list[torch.Tensor], coef: torch.Tensor) -> None:
        """The clip coefficient is folded into the next step's kernel (``grad_scale``) instead of
        rewriting the gradients in place; with 16-bit masters the 16-bit gradients are multiplied
        in place (rounded once, as the device stepper and DeepSpeed's offload do)."""
        if self._low_master:
            for g in grads:
                g.detach().mul_(coef)
            return
        self._clip_coef *= float(coef)

    def clamp(self, grads: list[torch.Tensor], value: float, loss_scale: float) -> None:
        """Value clipping (``Strategy.clip_grad_value_``) on the host gradient copies the kernel
        reads (the device partitions are not what it steps on, on the GPU path), of the slots
        whose partitions are ``grads`` (the optimizer stepping). They may still carry the loss
        scale, so the bound is scaled by it: clamp(g * s, +-v * s) = s * clamp(g, +-v)."""
        assert self.transfer is not None, "setup must run before a step"
        bound = value * self.transfer.host_grad_scale(loss_scale)
        if self.swapped_grads is not None:  # applied where each gradient is next read
            self.swapped_grads.clamp(self._slots_of(grads), bound)
            return
        self.transfer.grads_ready()  # the copies of the last reductions have landed
        for g in self.transfer.host_grads_of(grads):
            g.clamp_(-bound, bound)

    def step(self, sharded: Any, loss_scale: float) -> None:
        """The host stepper, given one gradient multiplier: the clip coefficient, divided by the
        loss scale the host gradient copies still carry (the transfer says which: the GPU path
        copies them during backward, before the plugin unscaled the device partitions)."""
        sharded.step(grad_scale=self._clip_coef / self.transfer.host_grad_scale(loss_scale))
        self._wrote_working = True

    def zero(self, sharded: Any) -> None:
        """End of a step (and zeroing): the folded clip coefficient was this step's only."""
        self._clip_coef = 1.0

    def zero_grads(self, slots: list[int] | None) -> None:
        """The stage zeroes the gradients of master slots ``slots`` (all when None): those in
        the swap files are only marked zero."""
        if self.swapped_grads is not None:
            self.swapped_grads.zero(slots)

    def _slots_of(self, grads: Sequence[torch.Tensor]) -> list[int]:
        """The master slots whose stage-side (meta) gradient partitions are ``grads``."""
        return [self._grad_slot[id(g)] for g in grads]

    def before_refresh(self, sharded: Any) -> None:
        sharded.import_loaded_state()  # after ZeRO-3's own loads (optimizer.load_state_dict)

    def took_working(self) -> bool:
        """ZeRO-3, before it refreshes the working shards: True right after a step (the kernel, or
        the host step, wrote each stepped sub-group's working values from its new master), so the
        shards need no second copy; False after a load (the stage filled the masters only)."""
        wrote, self._wrote_working = self._wrote_working, False
        return wrote

    def updated(self, sharded: Any, working: list[torch.Tensor]) -> list[torch.Tensor]:
        """What stages 1/2 all-gather after a step: the kernel already wrote the working
        partitions."""
        return working

    def exposed_state(self, sharded: Any) -> "contextlib.AbstractContextManager":
        return sharded.exposed_state()

    # ------------------------------------------------------------------ memory, reports, end
    def adjust_memory(self, out: dict[str, list[torch.Tensor]], sharded: Any) -> None:
        """Masters as the stepper holds them, its transfer buffers, and no file-backed shards."""
        out["master"] = sharded.master_tensors() if sharded else []
        out["comm_buffers"] += self.transfer.buffers() if self.transfer else []
        # gradient partitions in the swap files are meta tensors; their staging buffers are RAM
        out["grads"] = [g for g in out["grads"] if g.device.type != "meta"] + \
            (self.swapped_grads.staging() if self.swapped_grads else [])
        mapped = {sh.tensor.untyped_storage().data_ptr() for sh in self._param_shards}
        for cat in ("params", "master"):
            out[cat] = [t for t in out[cat] if t.untyped_storage().data_ptr() not in mapped]

    def report(self, sharded: Any, stage: int) -> dict[str, Any]:
        """Where the optimizer state is, and how it moves (for logs and tests)."""
        states = getattr(sharded, "states", None)
        swapped = isinstance(states, SwappedStates)
        return {"stage": stage, "optimizer_device": self.policy.optimizer_device,
                "param_device": self.policy.param_device,
                "optimizer_state_dtype": self.policy.optimizer_state_dtype,
                "grad_device": self.policy.grad_device,
                "grad_bytes_written": self.swapped_grads.bytes_written if self.swapped_grads else 0,
                "fused_adam": isinstance(sharded, OffloadedAdam),
                "subgroups": len(getattr(sharded, "subgroups", [])),
                "swapped_kinds": list(states.kinds) if swapped else [],
                "io_mode": self.direct_io.mode if swapped else None,
                "io_reason": self.direct_io.reason if swapped else None,
                "disk_bytes": states.disk_bytes() if swapped else 0,
                "swap_dir": states.directory if swapped else None,
                "bytes_read": self.io.bytes_read if self.io else 0,
                "bytes_written": self.io.bytes_written if self.io else 0,
                "param_dir": self._param_dir,
                "param_disk_bytes": sum(s.nbytes for s in self._param_shards)}

    def log_setup(self, sharded: Any, stage: int) -> None:
        rep = self.report(sharded, stage)
        where = (f"swap files ({'+'.join(rep['swapped_kinds'])}) in {rep['swap_dir']} "
                 f"({format_bytes(rep['disk_bytes'])}, {rep['io_mode']}: {rep['io_reason']})"
                 if rep["io_mode"] else "host RAM")
        log.info("offload: stage %d, optimizer state in %s, %d sub-groups of <= %d elements, %s", stage,
                 where, rep["subgroups"], self.policy.sub_group_size,
                 "fused Adam" if rep["fused_adam"] else "the optimizer's own step")

    def teardown(self) -> None:
        """Stops the I/O threads. Swap files stay until this part is garbage-collected (or the
        process exits): ``full_state_dict()`` or a checkpoint may still follow ``fit``, reading
        the state back (threads restart on demand)."""
        if self.swapped_grads is not None:
            self.swapped_grads.flush()  # a failed gradient write is reported here, not lost
        if self.io is not None:
            self.io.close()

    def __repr__(self) -> str:
        return f"OffloadStepper({self.policy})"


def _close_quietly(*objs: Any) -> None:
    for obj in objs:
        with contextlib.suppress(Exception):
            obj.close()


def _remove_param_files(shards, directory: str) -> None:
    _close_quietly(*shards)
    with contextlib.suppress(OSError):
        os.rmdir(directory)
