"""What ZeRO stages share: flat working parameters, fp32 master slices with the user's optimizer
re-targeted onto them, the step, clipping, checkpoints and the memory report.

A stage differs only in how gradients reach this rank's partition; it supplies that as a
:class:`GradientShards` object built in ``_build_gradients()`` (stage 1: full gradients, reduced
bucket by bucket during the synchronising backward; stage 2: bucketed reduction during every
backward into partition buffers). ``overlap_param_gather`` leaves the post-step all-gathers in
flight (``inflight.Work.PARAMS``) until a forward (``hooks.ParamGatherHooks``) or another reader
needs them. Every collective is filed in one in-flight layer, ``self.queue`` (``comm/inflight.py``).

After ``setup_optimizer`` each rank holds:

* the whole model in the working dtype (``precision.param_dtype``), one flat padded buffer per
  optimizer param group, parameters being views into it;
* its fp32 master slice of each group (a view of the working buffer when that is fp32);
* the optimizer's state for those slices only;
* whatever gradient buffers its stage keeps.

Step (``Strategy.optimizer_step``, with the pieces this class supplies): wait for last step's
overlapped gathers -> fp32 gradient slices -> unscale and check overflow (one collective, fp16
only) -> clip (an all-reduce of per-parameter norms, ``grad_norm.py``) -> inner
``optimizer.step()`` on the slices -> all-gather the updated slices into every rank's working
buffers -> zero gradients.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Protocol

import torch
from torch import nn

from ..base import PROCESS_GROUP_TIMEOUT_S, Strategy
from ...ops import host_cache
from ..memory.host import set_mmap_threshold
from ..memory import count_bytes
from ..optimizers import group_indices, refuse_shared
from ..environment import mesh_sizes
from ..parallel.tensor_checkpoint import TensorAxis
from ..parallel.tensor_plan import cut_for_mesh
from .comm.collectives import all_reduce_sum, backend, broadcast_from, global_rank, world_size
from ..options import expose_options
from .config import BucketConfig, Stage3Config, ZeroConfig, ZeroSpec
from ..memory.formula import estimate_model_states, format_bytes
from .experts import Partitioning, expert_norm_entries, group_kind, partitioning, refuse_frozen_experts
from .flat_buffer import FlatParamGroup, flatten_group
from .comm.grad_norm import ParamNorm, exact_total_norm, plan_param
from .hooks import ParamGatherHooks
from .comm.inflight import InFlight, InFlightQueue, Work
from .layout import build_layout
from .sharded_optimizer import ShardedOptimizer
from .shards import ZeroCheckpoint
from .stepper import ShardedStepper, Stepper

log = logging.getLogger("zerotrain")


class GradientShards(Protocol):
    """How one stage gets reduced gradients into this rank's partitions."""

    def before_backward(self) -> None: ...

    def after_backward(self, sync: bool) -> None:
        """Called after each micro-batch's backward; ``sync`` is False inside ``no_sync()``."""

    def partitions(self) -> list[torch.Tensor]:
        """This rank's reduced gradient slice of each group (any float dtype), valid after a
        synchronising backward."""

    def zero(self, slots: list[int] | None = None) -> None:
        """Zero the gradient buffers (of the ``partitions()`` indices ``slots`` only, when given:
        one optimizer's, the others keep accumulating)."""

    def persistent(self) -> list[torch.Tensor]:
        """Gradient buffers kept between steps (for the memory report)."""

    def comm_buffers(self) -> list[torch.Tensor]: ...

    def open(self) -> None:
        """(Re)install what ``close()`` removed; nothing when in place (idempotent)."""

    def close(self) -> None: ...


def trainable_groups(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[nn.Parameter]]:
    """The optimizer's groups, keeping parameters that require grad; checks that they are exactly
    the module's trainable parameters."""
    owned = {id(p): name for name, p in module.named_parameters()}
    seen: dict[int, int] = {}
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        kept = []
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the module: build the optimizer on "
                                 "module.parameters()")
            if id(p) in seen:
                raise ValueError(f"parameter {owned[id(p)]!r} is in optimizer param groups "
                                 f"{seen[id(p)]} and {gi}: put each parameter in one group")
            seen[id(p)] = gi
            if p.requires_grad:
                if not p.is_floating_point():
                    raise ValueError(f"parameter {owned[id(p)]!r} has dtype {p.dtype}: ZeRO "
                                     "trains floating-point parameters only")
                kept.append(p)
        groups.append(kept)
    missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"trainable parameters {missing[:5]} are in no optimizer param group: add "
                         "them to the optimizer or set requires_grad=False")
    return groups


class ZeroStrategy(Strategy):
    """A ZeRO stage built from a :class:`~.config.ZeroSpec` and a stepper (the optimizer part:
    :class:`~.stepper.ShardedStepper` on the device by default, offload's on the host). Options
    may also be given flat (``ZeroStage2(reduce_bucket_size=...)``): each goes to the section of
    the spec that has a field of its name."""

    stage = 0
    #: each parameter's optimizer state is one partition of one flat group
    optimizers_may_share_parameters = False
    #: with a tensor axis, tensor-parallel parameters saved whole and loaded cut (parallel/tensor_checkpoint.py)
    checkpoint_adapter = TensorAxis(ZeroCheckpoint)
    #: partitioned and reduced over ``replica_group`` (the ranks holding the same parameters)
    mesh_axes = ("sequence", "tensor")

    def __init__(self, spec: ZeroSpec | None = None, stepper: Stepper | None = None, *,
                 process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S, sequence_parallel: int = 1,
                 tensor_parallel: int = 1, **options: Any) -> None:
        super().__init__(process_group_timeout_s=process_group_timeout_s, sequence_parallel=sequence_parallel)
        self.parallel_sizes = mesh_sizes(type(self).__name__, sequence=sequence_parallel, tensor=tensor_parallel)
        if spec is None:
            spec = ZeroSpec.from_options(self.stage, owner=self.name, **options)
        elif options:
            raise TypeError(f"{self.name}: give the options in spec= or as keywords, not both "
                            f"(got spec and {sorted(options)})")
        if spec.stage != self.stage:
            raise ValueError(f"{self.name}: spec.stage={spec.stage} does not match this stage ({self.stage})")
        self.spec, self.config, self.buckets, self.stage3 = spec, spec.zero, spec.buckets, spec.stage3
        self.stepper: Stepper = stepper if stepper is not None else ShardedStepper()
        self.stepper.check_stage(self.stage)
        self.name = self.stepper.name or type(self).name
        policy = self.stepper.policy
        if self.config.master_dtype != "fp32" and policy is not None and \
                (policy.optimizer_device, policy.param_device) != ("cpu", "none"):
            raise ValueError(f"{self.name}: master_dtype={self.config.master_dtype!r} with optimizer_device="
                             f"{policy.optimizer_device!r}, param_device={policy.param_device!r}: 16-bit masters are "
                             "stepped in host RAM only; valid: optimizer_device='cpu' and param_device='none', or "
                             "master_dtype='fp32'")
        if self.config.master_dtype != "fp32" and policy is not None and self.config.reduce_dtype != self.config.master_dtype:
            raise ValueError(f"{self.name}: master_dtype={self.config.master_dtype!r} with reduce_dtype="
                             f"{self.config.reduce_dtype!r}: the host steps 16-bit masters with gradients of their own "
                             f"type; valid: reduce_dtype={self.config.master_dtype!r}")
        #: where masters and optimizer state live (None: with the working parameters)
        self.offload = self.stepper.policy
        #: with ``buckets.overlap_param_gather`` the post-step all-gathers are left in flight;
        #: forwards wait per module (``hooks.ParamGatherHooks``), every other reader for all
        #: (``Work.PARAMS``)
        self._param_hooks: ParamGatherHooks | None = None  # installed at the first such gather
        self._gather_plan: list | None = None  # planned at the first overlapped gather
        self.group: object = None  # the replicas' process group (None: the default group), at set-up
        self.flat_groups: list[FlatParamGroup] = []
        #: who partitions each flat group: the replicas, or an expert group's EDP group (``experts.py``)
        self._partitions: list[Partitioning] = []
        self.sharded: Any = None  # the stepper's optimizer (ShardedOptimizer, or offload's)
        self.grads: GradientShards | None = None
        self.reduce_mode: str | None = None  # "auto" resolved at setup_optimizer
        self.queue = InFlightQueue(overlap=self.config.overlap_comm)
        self._sync = True  # False inside no_sync()
        self._logged_after_step = False
        self._norm_plan: list[ParamNorm] | None = None  # planned at the first clip by norm

    # ------------------------------------------------------------------ set-up
    def check_precision(self, precision: Any, name: str) -> None:
        self.config.check_master_dtype(precision.param_dtype, name)

    def setup_environment(self) -> None:
        """The process group, then the host allocator's threshold (``host_mmap_threshold``) and,
        on a CPU rank, the host cache (``host_cache_min_bytes``) on this rank, before the model is
        built."""
        super().setup_environment()
        self.group = self.replica_group  # the ranks holding the same parameters (None: every rank)
        set_mmap_threshold(self.config.host_mmap_threshold)
        if self.device.type == "cpu" and self.config.host_cache_min_bytes:
            host_cache.enable(self.config.host_cache_min_bytes, self.config.host_cache_slack_bytes)

    def setup_module(self, module: nn.Module) -> None:
        super().setup_module(module)
        cut_for_mesh(self)  # a tensor axis: the module's own plan (parallel/tensor_plan.py), before flattening

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.module is not None, "setup_module must run before setup_optimizer"
        refuse_shared(self, optimizer)
        self.stepper.check(self.stage, self.device, optimizer, self.precision)
        self.check_precision(self.precision, type(self.precision).__name__)
        groups = trainable_groups(optimizer, self.module)
        names = {id(p): n for n, p in self.module.named_parameters()}
        kinds = [group_kind(i, params, names) for i, params in enumerate(groups)]
        refuse_frozen_experts(self.module, self.name)
        self._broadcast_extras()
        self._partitions = [partitioning(k, self.group, self.replica_rank, self.replica_world_size) for k in kinds]
        masters = []
        for params, part in zip(groups, self._partitions):
            layout = build_layout([p.numel() for p in params], part.size, self.config.partition_alignment)
            fg, master = flatten_group(params, layout, self.precision.param_dtype, part.rank, self.queue,
                                       part.group, self.config.torch_master_dtype)
            self.flat_groups.append(fg)
            masters.append(master)
        self.optimizer = optimizer
        self.reduce_mode = self.config.resolved_reduce_mode(backend(self.group), world_size(self.group))
        self.grads = self._build_gradients()
        self._attach_stepper(ShardedOptimizer(optimizer, masters), self._working_partitions())

    def master_pieces(self) -> tuple[list[list[nn.Parameter]], list[list[tuple[nn.Parameter, int, int, int]]]]:
        """After ``setup_optimizer``: the trainable parameters of each flat group, and what each
        master slot (one per flat group here: ``sharded.masters[k]``, ``grads.partitions()[k]``)
        holds on this rank: ``(parameter, first element in the parameter, first element in the
        slot, count)`` per piece, in slot order (ZeRO-3's ``master_pieces`` has the same form)."""
        slots = [[(fg.params[pc.index], pc.param_start, pc.partition_start, pc.numel) for pc in fg.layout.pieces(fg.rank)]
                 for fg in self.flat_groups]
        return [list(fg.params) for fg in self.flat_groups], slots

    def _working_partitions(self) -> list[torch.Tensor]:
        """This rank's slice of each group's working buffer (what an offload stepper writes)."""
        return [fg.partition(fg.rank) for fg in self.flat_groups]

    def _attach_stepper(self, sharded: ShardedOptimizer, working: list[torch.Tensor],
                        masters_external: bool = False) -> None:
        """Hand the laid-out masters, gradients and working slices to the stepper; it returns what
        steps from now on."""
        def on_reduced(fn):
            self.grads.on_reduced = fn

        self.sharded = self.stepper.setup(sharded, lambda: (self.grads.partitions(), working), self.device,
                                          self.replica_rank, masters_external, on_reduced, lambda: self._sync)
        #: the param group of each master slot (``partitions()`` index), for one optimizer's step
        self._slot_groups = [gi for gi, g in enumerate(self.optimizer.param_groups) for _ in g["params"]]
        self.stepper.log_setup(self.sharded, self.stage) if self.is_global_zero else None
        self._log_memory("at setup (optimizer state is allocated by the first step)")
        host_cache.empty()  # set-up's transient blocks: training's own peak bounds the cache

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate without the synchronising reduction where the stage
        defers it (stage 1); stages 2/3 reduce every micro-batch, and this only says which
        backward's gradients are final."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _reduction_args(self) -> tuple:
        """What stages 1/2's bucketed reduction (``reduction.BucketedReduction``) is built from."""
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        return (self.flat_groups, self.replica_rank, self.config.torch_reduce_dtype, self.reduce_mode,
                self.buckets.reduce_bucket_size, self.queue, order, self.group)

    def _build_gradients(self) -> GradientShards:
        raise NotImplementedError

    def _broadcast_extras(self) -> None:
        """Collective: rank 0's buffers and frozen parameters everywhere (as DDP does)."""
        if self.replica_world_size == 1:
            return
        sd = self.module.state_dict(keep_vars=True)
        for name in self.checkpointer.extra_names():
            t = sd[name].data if isinstance(sd[name], torch.Tensor) else None
            if t is not None and t.numel():
                handle = broadcast_from(t, global_rank(self.group, 0), self.group)
                self.queue.push(InFlight((handle,), (t,), _nothing, name))
        self.queue.wait(Work.BUCKETS)

    @property
    def pending(self) -> tuple[InFlight, ...]:
        """The post-step parameter all-gathers still in flight (``overlap_param_gather``)."""
        return self.queue.entries(Work.PARAMS)

    # ------------------------------------------------------------------ pieces of the step
    # (the sequence is Strategy.backward / Strategy.optimizer_step)
    def _before_backward(self) -> None:
        assert self.grads is not None, "setup_optimizer must run before backward"
        self.grads.open()  # after a teardown (a second fit, or fit after a tuner's fit)
        self.grads.before_backward()

    def _after_backward(self) -> None:
        self.grads.after_backward(self._sync)

    def _gradients_ready(self) -> None:
        """Wait for the parameter all-gathers still in flight from the last step
        (``overlap_param_gather``): the step writes the masters they read. The gradient
        reductions already landed at the end of the synchronising backward."""
        assert self.sharded is not None, "setup_optimizer must run before optimizer_step"
        self.queue.wait(Work.PARAMS)

    def step_gradients(self) -> list[torch.Tensor]:
        """This rank's gradient slice of each group, as the stepper steps on it (of the selected
        optimizer's groups inside ``optimizer_step(which=k)``)."""
        grads = self.stepper.gradients(self.grads.partitions(), self.sharded)
        slots = self._slots(self._step_groups)
        return grads if slots is None else [grads[i] for i in slots]

    def _slots(self, groups: list[int] | None) -> list[int] | None:
        """The master slots (``partitions()`` indices) of param groups ``groups``."""
        if groups is None:
            return None
        wanted = set(groups)
        return [i for i, g in enumerate(self._slot_groups) if g in wanted]

    def _scale_grads(self, coef: torch.Tensor) -> None:
        self.stepper.scale(self.step_gradients(), coef)

    def _clamp_grads(self, clip_value: float, loss_scale: float) -> None:
        self.stepper.clamp(self.step_gradients(), clip_value, loss_scale)

    def _grad_norm(self) -> torch.Tensor:
        """Collective: the global L2 norm, rounded exactly as ``torch.nn.utils.clip_grad_norm_``
        over the full gradients rounds it (``grad_norm.py``: per-parameter norms, then their norm)."""
        if self._norm_plan is None:
            self._norm_plan = self._plan_norms()
        grads = self.stepper.gradients(self.grads.partitions(), self.sharded)
        groups = None if self._step_groups is None else set(self._step_groups)
        total = exact_total_norm(self._norm_plan, self.stepper.norm_reader(grads), groups, self.device,
                                 lambda h, t, label: self.queue.complete(h, t, label=label),
                                 self.group, self.replica_rank == 0, self.mesh_group("tensor"))
        factor = self.stepper.norm_factor()
        return total if factor == 1.0 else total * factor

    def grad_norm_bytes(self) -> int:
        """All-reduce bytes one clip by norm moves (``callbacks/measure/comms.py``'s formula): the vector
        of per-parameter norms (fp32) and each parameter a partition boundary cuts, whole (fp32)."""
        if self._norm_plan is None:
            self._norm_plan = self._plan_norms()
        return 4 * (len(self._norm_plan) + sum(p.numel for p in self._norm_plan if not p.whole))

    def _plan_norms(self) -> list[ParamNorm]:
        """Each trainable parameter in the optimizer's order, with where its gradient lies (one
        master slot per flat group here); an expert's once per expert-parallel place (``experts.py``)."""
        plan: list[ParamNorm] = []
        for gi, (fg, part) in enumerate(zip(self.flat_groups, self._partitions)):
            if part.experts is not None:
                plan += expert_norm_entries(gi, fg.params, fg.layout, part)
            else:
                plan += [dataclasses.replace(plan_param(gi, p.shape, fg.layout, i, fg.rank, lambda s, gi=gi: (gi, s)),
                                             tensor_parallel=hasattr(p, "tensor_parallel"))
                         for i, p in enumerate(fg.params)]
        return plan

    @property
    def holds_experts(self) -> bool:
        """Whether some flat group is an expert group's, partitioned over its EDP group."""
        return any(part.experts is not None for part in self._partitions)

    @property
    def reduces_expert_gradients(self) -> bool:
        """Expert parameters (moe/) are partitioned and reduced over their expert-data-parallel
        group: stages 1/2 on the device (``experts.py``); others refuse them at set-up."""
        return self.stage in (1, 2) and self.offload is None

    def _inner_step(self, loss_scale: float) -> None:
        self.stepper.step(self.sharded, loss_scale)

    def zero_grad(self, which: int | None = None) -> None:
        """Zero the gradient partitions (optimizer ``which``'s only: the others accumulate on)."""
        self.stepper.zero(self.sharded)
        slots = self._slots(group_indices(self.optimizer, which))
        self.grads.zero(slots)
        self.stepper.zero_grads(slots)

    def _end_step(self) -> None:
        self.stepper.zero(self.sharded)

    def _after_step(self, stepped: bool) -> None:
        if stepped and not self._logged_after_step:
            self._logged_after_step = True
            self._log_memory("after the first step")

    def _refresh_params(self) -> None:
        """All-gather the updated slices (the stepper says which: the masters, or the working
        partitions an offload kernel wrote) into every rank's working buffers."""
        self.queue.wait(Work.PARAMS)
        self.stepper.before_refresh(self.sharded)
        updated = self.stepper.updated(self.sharded, self._working_partitions())
        stepped = set(range(len(self.flat_groups)) if self._step_groups is None else self._step_groups)
        if not self.buckets.overlap_param_gather:
            for fg, values in (x for g, x in enumerate(zip(self.flat_groups, updated)) if g in stepped):
                fg.gather_from(values, fg.rank, self.buckets.allgather_bucket_size, self.queue, fg.group)
            return
        # launch every chunk of every group, in the order forward first needs them, and return
        if self._gather_plan is None:
            order = {id(p): i for i, p in enumerate(self.module.parameters())}
            plan = []
            for g, fg in enumerate(self.flat_groups):
                chunks = fg.gather_chunks(self.buckets.allgather_bucket_size)
                for s, e in chunks:
                    ids = frozenset(id(fg.params[i]) for i in fg.chunk_params(s, e))
                    first = min((order[i] for i in ids), default=len(order))
                    plan.append((first, g, s, e, len(chunks) == 1, ids))
            self._gather_plan = sorted(plan, key=lambda c: c[:2])
            self._param_hooks = ParamGatherHooks(self.queue, self.module,
                                                 [p for fg in self.flat_groups for p in fg.params])
        for _, g, s, e, single, writes in (c for c in self._gather_plan if c[1] in stepped):
            item = self.flat_groups[g].launch_gather(updated[g], s, e, single, self.flat_groups[g].group)
            self.queue.push(item._replace(writes=writes), Work.PARAMS)

    # ------------------------------------------------------------------ memory and end
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = {"params": list(self.module.parameters()) if self.module is not None else [],
               "grads": self.grads.persistent() if self.grads else [],
               "master": list(self.sharded.masters) if self.sharded else [],
               "optimizer": self.sharded.state_tensors() if self.sharded else [],
               "comm_buffers": self.grads.comm_buffers() if self.grads else []}
        self.stepper.adjust_memory(out, self.sharded)
        return out

    def offload_report(self) -> dict[str, Any]:
        """Where the optimizer state is, and how it moves (for logs and tests)."""
        return self.stepper.report(self.sharded, self.stage)

    def _model_numel(self) -> int:
        """Trainable elements laid out by this stage (for the formula in the memory log)."""
        return sum(fg.layout.numel for fg in self.flat_groups)

    def _grad_bytes_per_param(self) -> int:
        """Bytes per parameter of the gradients this stage keeps (for the formula)."""
        return self.precision.param_dtype.itemsize

    def _log_memory(self, when: str) -> None:
        if not self.is_global_zero or not self.stepper.formula or not log.isEnabledFor(logging.INFO):
            return
        psi = self._model_numel()
        pdt = self.precision.param_dtype
        est = estimate_model_states(
            psi, self.replica_world_size, param_bytes=pdt.itemsize, grad_bytes=self._grad_bytes_per_param(),
            master_bytes=0 if self.config.torch_master_dtype == pdt else 4,
            optimizer_bytes=2 * self.config.torch_master_dtype.itemsize)[f"zero{self.stage}"]
        got = count_bytes(self)
        parts = ", ".join(f"{k} {format_bytes(got[k])} (formula {format_bytes(getattr(est, k))})"
                          for k in ("params", "grads", "master", "optimizer"))
        log.info("%s: model states per rank %s, %s; total %s (formula %s, optimizer counted as Adam's "
                 "%d B/param); communication buffers %s; %d trainable params on %d ranks", self.name,
                 when, parts, format_bytes(got["total"] - got["comm_buffers"]), format_bytes(est.total),
                 2 * self.config.torch_master_dtype.itemsize,
                 format_bytes(got["comm_buffers"]), psi, self.replica_world_size)

    def teardown(self) -> None:
        self.queue.wait(Work.PARAMS)
        if self.grads is not None:
            self.grads.close()
        self.queue.wait_all()
        self.stepper.teardown()
        super().teardown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, {self.spec.options()}, {self.stepper})"


def _nothing() -> None:
    pass


# the flat options ZeroSpec.from_options routes, as keyword parameters for introspection (zerotrain.cli)
expose_options(ZeroStrategy.__init__, ZeroConfig, BucketConfig, Stage3Config)

