"""Data parallelism with torch's DistributedDataParallel: the baseline every other strategy is
measured against. Gradients are all-reduced in buckets during backward; each rank keeps the whole
model and optimizer."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from . import instrument
from .environment import mesh_sizes, release_at_exit
from .base import PROCESS_GROUP_TIMEOUT_S, Strategy
from .checkpoint import ReplicatedCheckpoint
from .moe.grads import expert_norm_sq, expert_params, reduce_expert_grads
from .parallel import tensor_parallel_norm
from .parallel.tensor_checkpoint import TensorAxis
from .parallel.tensor_plan import cut_for_mesh, refuse_stale_optimizer
from .step_wrapper import StepWrapper
from .options import check_bool, check_choice, config_from, expose_options
from .zero.comm.collectives import all_gather_into
from .zero.config import REDUCE_DTYPES


@dataclass(frozen=True)
class DDPConfig:
    """``DistributedDataParallel``'s own options (see its documentation)."""

    #: megabytes per gradient all-reduce bucket
    bucket_cap_mb: float = 25.0
    #: allow parameters that get no gradient in some steps (costs a graph traversal per step)
    find_unused_parameters: bool = False
    #: gradients are views into the all-reduce buckets (saves one copy of the gradients)
    gradient_as_bucket_view: bool = True
    #: the graph is the same every step (lets DDP skip per-step bookkeeping)
    static_graph: bool = False
    #: log every collective (op, bytes, time, bus bandwidth) and summarise it at the end of fit
    #: (``callbacks.CommsLogger``)
    comms_logger: bool = False
    #: the type gradients are summed in ("fp32", "bf16", "fp16"); 16-bit: summed in that type, then
    #: divided by the world size, as DeepSpeed's engine does without ZeRO (its communication_data_type)
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        v = self.bucket_cap_mb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"DDP: bucket_cap_mb={v!r} must be > 0")
        for f in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph", "comms_logger"):
            check_bool("DDP", f, getattr(self, f))
        check_choice("DDP", "reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)


class DDPStrategy(Strategy):
    name = "ddp"
    #: gradients are averaged over ``replica_group`` (the ranks holding the same parameters)
    mesh_axes = ("sequence", "tensor")  # tensor_parallel=n: the module cut by its own tp_plan at set-up
    inference_mode_evaluation = True
    supports_float64 = True
    evaluates_without_optimizer = True
    #: with a tensor axis, tensor-parallel parameters saved whole and loaded cut (parallel/tensor_checkpoint.py)
    checkpoint_adapter = TensorAxis(ReplicatedCheckpoint)

    def __init__(self, config: DDPConfig | None = None, *,
                 process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S, sequence_parallel: int = 1,
                 tensor_parallel: int = 1, process_group: Any = None, **options: Any) -> None:
        super().__init__(process_group_timeout_s=process_group_timeout_s, sequence_parallel=sequence_parallel)
        self.parallel_sizes = mesh_sizes(type(self).__name__, sequence=sequence_parallel, tensor=tensor_parallel)
        self.config = config_from(DDPConfig, config, options, "DDP")
        if process_group is not None and any(n > 1 for n in self.parallel_sizes.values()):
            raise ValueError(f"DDP: process_group={process_group!r} with sequence_parallel={sequence_parallel!r}, "
                             f"tensor_parallel={tensor_parallel!r}; valid: a process group with neither (the mesh "
                             "makes its own groups)")
        #: the ranks DDP averages gradients over (Fabric's ``DDPStrategy(process_group=...)``, a group
        #: the user made with ``torch.distributed.new_group``); None: every replica. Only the model's
        #: wrapper uses it: the samplers, ``barrier``/``all_reduce``/``broadcast`` span the job, as Fabric's
        self.process_group = process_group

    @property
    def replica_group(self) -> "dist.ProcessGroup | None":
        return super().replica_group if self.process_group is None else self.process_group

    @property
    def replica_world_size(self) -> int:
        return super().replica_world_size if self.process_group is None else dist.get_world_size(self.process_group)

    @property
    def replica_rank(self) -> int:
        return super().replica_rank if self.process_group is None else dist.get_rank(self.process_group)

    def setup_module(self, module) -> None:
        super().setup_module(module)
        cut_for_mesh(self)  # a tensor axis: the module's own plan (parallel/tensor_plan.py), before wrapping
        if not self.distributed:
            return  # one process: DDP would only add overhead
        ids = [self.device.index] if self.device.type == "cuda" else None
        wrapper = StepWrapper(self.module, self.step_call)
        # experts (moe/): left out of torch's reducer and its start-up broadcast, reduced over
        # their expert-data-parallel group after backward (moe/grads.py)
        experts = expert_params(wrapper)
        if experts and self.process_group is not None:
            raise ValueError("DDP: process_group= with expert layers (moe/); valid: one of them (experts reduce "
                             "over their own expert-data-parallel groups)")
        self._experts = list(experts.values())
        if experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, list(experts))
        self.model = DistributedDataParallel(
            wrapper, device_ids=ids, bucket_cap_mb=self.config.bucket_cap_mb, process_group=self.replica_group,
            find_unused_parameters=self.config.find_unused_parameters,
            gradient_as_bucket_view=self.config.gradient_as_bucket_view, static_graph=self.config.static_graph)
        self._armed = False  # the last forward armed DDP's reducer and no backward has used that yet
        self._inner_backward = False  # a manual backward ran inside the running forward
        self._sync_after: bool | None = None  # require_backward_grad_sync to restore after the forward
        self.model.register_forward_pre_hook(self._forward_starts)
        self.model.module.register_forward_hook(self._inner_forward_done)
        self.model.register_forward_hook(self._forward_done)
        world, watch = self.replica_world_size, instrument.active()
        # gloo sums a bucket's values in an order that depends on their place in the bucket with
        # more than 2 ranks, and DDP's first step after a start uses its unrebuilt buckets: a
        # resume would round that step differently from a run that never stopped (the fault
        # campaign, issue 40). There the sum is taken in rank order, whatever the layout.
        ordered = self.sums_in_rank_order = world > 2 and dist.get_backend(self.replica_group) == "gloo"
        low = None if self.config.reduce_dtype == "fp32" else REDUCE_DTYPES[self.config.reduce_dtype]
        hook = _BucketHook.attach(self.model, ordered, watch, low, self.replica_group) if ordered or watch or low else None
        self._buckets = hook if watch else None
        release_at_exit(self)

    def release_at_exit(self) -> None:
        """Interpreter exit: drop the DistributedDataParallel wrapper (its reducer holds the process
        group) so that the group's destruction joins gloo's threads (``environment.release_at_exit``)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module
        self._buckets = None

    # Manual optimization runs its backwards inside the training step, i.e. inside DDP's forward,
    # whose end would then arm the reducer for a backward that never comes (the next forward's
    # bucket rebuild fails on it). As Lightning does: a forward that ran a backward inside does
    # not arm the reducer (require_backward_grad_sync off around DDP's end of forward), and each
    # manual backward arms it for itself (``_before_manual_backward``).
    def _forward_starts(self, module: Any, args: Any) -> None:
        self._armed = self._inner_backward = False

    def _inner_forward_done(self, module: Any, args: Any, output: Any) -> None:
        if self._inner_backward:
            self._sync_after, self.model.require_backward_grad_sync = self.model.require_backward_grad_sync, False

    def _forward_done(self, module: Any, args: Any, output: Any) -> None:
        if self._sync_after is not None:
            self.model.require_backward_grad_sync, self._sync_after = self._sync_after, None
        else:  # DDP's forward armed its reducer for one backward (gradients enabled and syncing)
            self._armed = torch.is_grad_enabled() and self.model.require_backward_grad_sync

    def _forward_armed(self) -> bool:
        """Whether the last forward's arming is still unused (and now taken by this backward)."""
        armed, self._armed = self._armed, False
        return armed

    def no_sync(self):
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    _buckets: "_BucketHook | None" = None
    #: gradients are summed in rank order (every rank's bucket all-gathered), not all-reduced
    sums_in_rank_order = False

    _experts: list = []
    #: expert parameters (moe/) are summed over their expert-data-parallel group, not the world
    reduces_expert_gradients = True

    def _after_backward(self) -> None:
        if self._buckets is not None:
            self._buckets.settle()
        if self._experts and self.model.require_backward_grad_sync:
            reduce_expert_grads(self._experts, dist.get_world_size())

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        refuse_stale_optimizer(self.module, optimizer)
        super().setup_optimizer(optimizer)

    def _grad_norm(self) -> torch.Tensor:
        """With experts (moe/): the dense gradients' norm as the base computes it, joined with the
        norm of every expert of the model (each rank holds only its own: ``expert_norm_sq``). With
        a tensor axis: the sharded parameters' squares summed over the tensor group, the replicated
        ones' (equal on its ranks) counted once."""
        if self.mesh_size("tensor") > 1:
            if self._experts:
                raise NotImplementedError("DDP: experts (moe/) with tensor_parallel > 1 are not supported")
            return tensor_parallel_norm(self.module.parameters(), self.step_gradients(), self.mesh_group("tensor"))
        if not self._experts:
            return super()._grad_norm()
        experts = {id(p.grad) for p in self._experts if p.grad is not None}
        dense = [g.detach().float() for g in self.step_gradients() if id(g) not in experts]
        dense_sq = torch.nn.utils.get_total_norm(dense, norm_type=2.0) ** 2 if dense else torch.zeros(())
        return (dense_sq.to(self.device) + expert_norm_sq(self._experts).to(self.device)).sqrt()

    def _before_manual_backward(self, loss: torch.Tensor) -> None:
        """DDP arms its reducer for one backward at the end of each forward. Manual optimization
        runs several backwards after one training-step forward, so each is armed here for its own
        loss (the graph it searches for unused parameters, with ``find_unused_parameters``);
        gradients a backward leaves accumulate and are averaged with the next, which is exact as
        they are equal on every rank."""
        model = self.model
        if not isinstance(model, DistributedDataParallel) or not model.require_backward_grad_sync:
            return
        if not torch.is_grad_enabled():
            return
        self._inner_backward = True
        searches = model.find_unused_parameters and not model.static_graph
        if self._forward_armed() and not searches:
            return  # the forward armed the reducer for every parameter, as this backward needs
        model.require_forward_param_sync = True
        model.reducer._rebuild_buckets()  # due after the first iteration; never while armed
        model.reducer.prepare_for_backward(list(_find_tensors(loss)) if searches else [])


class _BucketHook:
    """DDP's gradient all-reduce as a comm hook: the bucket divided by the world size, then summed
    over ranks, as the reducer does.

    ``ordered``: the sum is taken in rank order (every rank's bucket is all-gathered, then added
    rank 0 first), so that a value's rounding does not depend on its place in the bucket: DDP
    builds different buckets for its first step than for the later ones (it rebuilds them in the
    order backward produced the gradients), and a run resumed from a checkpoint must round its
    first step as the uninterrupted run rounded that step. Moves ``world - 1`` buckets per rank
    instead of the ring's ``2 (world - 1) / world``.

    ``watch`` (only while a monitor listens, ``strategies/instrument.py``): each bucket's
    collective is reported. The reducer waits for the buckets in C++, out of sight: the time
    backward sat blocked is estimated as the stretch from the last bucket's launch (autograd is
    done by then) to the last bucket's completion."""

    def __init__(self, world: int, ordered: bool = False, watch: bool = True, dtype: torch.dtype | None = None,
                 group: Any = None) -> None:
        self.world, self.ordered, self.watch, self.dtype, self.group = world, ordered, watch, dtype, group
        self.last_issue: float | None = None
        self.last_done: float | None = None

    @classmethod
    def attach(cls, model: DistributedDataParallel, ordered: bool = False, watch: bool = True,
               dtype: torch.dtype | None = None, group: Any = None) -> "_BucketHook":
        hook = cls(dist.get_world_size(group), ordered, watch, dtype, group)
        model.register_comm_hook(None, hook.hook)
        return hook

    def hook(self, state, bucket):  # unannotated: DDP checks real annotations, these would be strings
        out = bucket.buffer()
        # fp32: divided, then summed; a 16-bit type: summed in it, then divided (DeepSpeed's order)
        buf = out.div_(self.world) if self.dtype is None else out.to(self.dtype)
        if self.ordered:
            fut = _sum_in_rank_order(buf, self.world, self.group)  # all_gather_into reports its collective
        else:
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            if self.watch:
                instrument.issued("all_reduce", work, self.group, buf)
            fut = work.get_future().then(lambda f: f.value()[0])
        if self.dtype is not None:
            fut = fut.then(lambda f: out.copy_(f.value().mul_(1.0 / self.world)))
        self.last_issue = time.perf_counter()
        return fut.then(self._landed)

    def _landed(self, fut: torch.futures.Future) -> torch.Tensor:
        self.last_done = time.perf_counter()
        return fut.value()

    def settle(self) -> None:
        """After backward (the reducer has waited for every bucket): report the blocked time."""
        if self.last_issue is not None and self.last_done is not None:
            instrument.blocked_for(self.last_done - self.last_issue)
        self.last_issue = self.last_done = None


def _sum_in_rank_order(buf: torch.Tensor, world: int, group: Any = None) -> torch.futures.Future:
    """A future of ``buf`` holding the sum over ``group``'s ranks of their ``buf``, added in rank order."""
    gathered = torch.empty(world * buf.numel(), dtype=buf.dtype, device=buf.device)
    handle = all_gather_into(gathered, buf, group)
    pieces = gathered.view(world, -1)

    def add(_: torch.futures.Future) -> torch.Tensor:
        torch.add(pieces[0], pieces[1], out=buf)
        for piece in pieces[2:]:
            buf.add_(piece)
        return buf

    return handle.get_future().then(add)


# DDPConfig's fields as keyword parameters of DDP(...) for introspection (zerotrain.cli)
expose_options(DDPStrategy.__init__, DDPConfig)


#: zerotrain's short name for the same class (its own name is Lightning's)
DDP = DDPStrategy
