"""PipelineStrategy: pipeline stages x data-parallel replicas, behind the ordinary Strategy API.

The Trainer's calls map onto a pipeline like this:

* ``setup_environment``: join the world, lay out the grid (``PipelineGrid``: replica ``r`` is ranks
  ``r*stages .. r*stages+stages-1``) and make one data-parallel group per stage. With
  ``tensor_parallel=n`` each stage is ``n`` consecutive ranks, a tensor-parallel group
  (``tensor.py``): the stage is cut by the model's plan at ``configure_model``, activations and
  gradients travel between matching tensor ranks, and the data-parallel and tie groups join one
  tensor index each.
* ``configure_model``: the TrainModule builds itself; then its first ``PipelineModule`` (or, if it
  holds none, the one its ``to_pipeline(num_stages)`` returns: the demo GPT cuts itself so) builds
  only this rank's stage.
* ``setup_module``: make the tie groups (one per tie and replica, among the stages owning a copy),
  broadcast tied weights from their lowest owning stage and every stage from replica 0.
* ``run_schedule``: split the batch ``(inputs, targets)`` into ``micro_batches`` along dim 0 and run
  the whole 1F1B/GPipe schedule (every forward and backward, each backward's loss divided by
  ``hooks.accumulation``; with ``virtual_stages`` > 1 interleaved 1F1B over this stage's chunks,
  the stages of a replica joined in a ring). Returns the mean loss, averaged over replicas, identical on every rank,
  after checking it through ``hooks.loss_of``; the Trainer logs it as ``train_loss``. There is no
  single loss before the backwards nor one moment after them, so ``on_before_backward`` and
  ``on_after_backward`` are never called (``skipped_hooks``; the Trainer warns about callbacks
  that override them), and ``training_step``/``backward`` do not exist apart: calling either
  raises. The TrainModule's own ``training_step`` is not run (its ``PipelineModule``'s
  ``loss_fn`` is the loss).
* ``optimizer_step`` (the base sequence; this class supplies ``_gradients_ready`` and
  ``_grad_norm``): all-reduce tied gradients within each tie group (SUM), then every gradient
  within the data-parallel group (SUM, divide by replicas), unscale/skip as the precision says,
  clip by the global norm over all stages and replicas (tied weights counted once), step.
  ``skip_step`` reduces too (every rank skips together) before dropping the gradients.

The optimizer holds this stage's parameters only: ``parameters_for_optimizer()`` and the
TrainModule's own ``self.parameters()`` are the same set after ``configure_model``, so a
``configure_optimizers`` written for one process works unchanged. With ``zero_stage=1`` its state
(and the fp32 masters) is partitioned over the stage's data-parallel group (``zero1.StageZero1``):
the data-parallel reduction becomes one all-reduce whose partition each replica keeps, the norm
sums the partitions, and the step is followed by an all-gather of the updated slices.

Checkpoints (``checkpoint.PipelineCheckpoint``) and ``full_state_dict`` name every tensor as the non-pipelined model does
(``PipelineModule.plain_key``: ``model.3.attn...`` is ``model.blocks.1.attn...``), and a tied
parameter is saved once, by its lowest owning stage (with virtual stages: of the chunks holding
it), under its first name (``canonical_key``); under ZeRO-1 every replica of that stage writes its
partition's pieces. So a pipeline checkpoint is the per-parameter layout every strategy writes: it
resumes under another number of stages, replicas or chunks, with or without ZeRO-1, or as
zero/ddp/single, and consolidates; and theirs resume here. With ``tensor_parallel`` each stage's
tensor-parallel parameters and optimizer state are saved whole (``TensorAxis``: pp x tp resumes as
pp alone, single or dp x tp, and the other way).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..base import PROCESS_GROUP_TIMEOUT_S, BatchHooks, Strategy
from ..environment import release_at_exit
from ..memory import replicated_tensors
from ..options import config_from, expose_options
from ..parallel.mesh import mesh_sizes
from ..parallel.tensor_checkpoint import TensorAxis
from ..parallel.tensor_plan import plan_of
from .checkpoint import PipelineCheckpoint
from .collectives import all_reduce_grads, broadcast_tensors, sum_over_world
from .config import PipelineConfig
from .module import PipelineModule, Tie, find_pipeline_module
from .p2p import PipeComm
from .schedule import inference, interleaved_1f1b, schedule_from_name
from .stage import StageExecutor, StepStats, batch_rows, split_micro_batches
from .tensor import counted_once, cut_stage, tensor_groups
from .topology import PipelineGrid
from .zero1 import StageZero1


_NO_SEPARATE_STEP = ("pipeline: {call}() is not a step of its own here: the schedule interleaves every "
                     "micro-batch's forward and backward; valid: run_schedule(batch, batch_idx, hooks)")


@dataclass(frozen=True)
class TieGroup:
    """One tie as seen from this rank: its parameters here and the ranks sharing them."""

    tie: Tie
    ranks: tuple[int, ...]
    group: Any
    params: tuple[nn.Parameter, ...]


class PipelineStrategy(Strategy):
    name = "pipeline"
    skipped_hooks = ("on_before_backward", "on_after_backward")
    runs_own_schedule = True
    #: a tensor axis inside each stage (``tensor_parallel``); no sequence axis (its stages and
    #: replicas are its own grid, ``PipelineGrid``, not a ``ParallelMesh``)
    mesh_axes = ("tensor",)
    checkpoint_adapter = TensorAxis(PipelineCheckpoint)  # tensor_parallel: each stage's shards saved whole

    def __init__(self, config: PipelineConfig | None = None, *,
                 process_group_timeout_s: float = PROCESS_GROUP_TIMEOUT_S, tensor_parallel: int = 1,
                 **options: Any) -> None:
        super().__init__(process_group_timeout_s=process_group_timeout_s)
        self.parallel_sizes = mesh_sizes(type(self).__name__, sequence=1, tensor=tensor_parallel)
        self.config = config = config_from(PipelineConfig, config, options, "pipeline")
        self.schedule_name = config.schedule
        self._schedule = schedule_from_name(config.schedule)
        self.stages_option = config.stages
        self.micro_batches = config.micro_batches
        self.activation_checkpointing = config.activation_checkpointing
        self.virtual_stages = config.virtual_stages
        self.zero_stage = config.zero_stage
        self._zero: StageZero1 | None = None  # zero_stage=1: the partitioned optimizer state
        self.grid: PipelineGrid | None = None
        self.pipe: PipelineModule | None = None
        self.executor: StageExecutor | None = None
        self._dp_group: Any = None
        self._tp_group: Any = None  # this stage's tensor-parallel group (None: tensor_parallel=1)
        self._tie_groups: list[TieGroup] = []
        self._groups: list[Any] = []  # every subgroup this rank belongs to, destroyed in teardown
        self._pipe_prefix = ""  # the PipelineModule's path inside the TrainModule, with its dot
        #: most micro-batches whose activations this stage held at once, over all training steps
        self.live_activation_peak = 0
        #: the last training step's timings and peak on this stage
        self.last_step_stats = StepStats()
        #: the stages whose gradients the clipping norm counts (None: all, each tied weight once).
        #: ``zerotrain.deepspeed.pipe`` sets (0,): DeepSpeed 0.19.8's fp32 pipeline norm counts the
        #: first stage's gradients only (its model-parallel rank 0) and clips every stage by it
        self.norm_stages: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ topology
    def check_world_size(self, world_size: int) -> None:
        self.check_mesh(world_size)
        self.config.check_grid(self._grid_of(world_size).stages)

    def _grid_of(self, world_size: int) -> PipelineGrid:
        tensor = self.parallel_sizes.get("tensor", 1)
        return PipelineGrid(world_size, self.stages_option or max(1, world_size // tensor), tensor)

    def setup_environment(self) -> None:
        self.grid = self._grid_of(self.world_size)  # validates first
        self.config.check_grid(self.grid.stages)
        super().setup_environment()
        tensor = self.grid.tensor_of(self.global_rank)
        for stage in range(self.grid.stages):  # every rank creates every group, in the same order
            for t in range(self.grid.tensor):
                ranks = self.grid.data_parallel_ranks(stage, t)
                # ZeRO-1 partitions over the group even when it is this rank alone (never the world)
                group = self._new_group(ranks) if len(ranks) > 1 or (self.zero_stage and self.distributed) else None
                if (stage, t) == (self.stage, tensor):
                    self._dp_group = group
        if self.distributed:
            self._tp_group = tensor_groups(self.grid, self.global_rank, self._new_group)

    def build_mesh(self) -> None:
        """No ``ParallelMesh``: the stages are not one of its axes; the grid is the shape and
        ``setup_environment`` makes the tensor groups (``mesh_size`` / ``mesh_rank`` /
        ``mesh_group`` answer the tensor axis from them)."""
        self.mesh = None

    def mesh_size(self, axis: str) -> int:
        return self.parallel_sizes["tensor"] if axis == "tensor" else super().mesh_size(axis)

    def mesh_rank(self, axis: str) -> int:
        return self._grid().tensor_of(self.global_rank) if axis == "tensor" else super().mesh_rank(axis)

    def mesh_group(self, axis: str) -> Any:
        return self._tp_group if axis == "tensor" else super().mesh_group(axis)

    def _new_group(self, ranks: Sequence[int]) -> Any:
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=self.process_group_timeout_s))
        if self.global_rank in ranks:
            self._groups.append(group)
        release_at_exit(self)
        return group

    def release_at_exit(self) -> None:
        """Interpreter exit: drop this rank's references to its subgroups (replicas, ties, ZeRO-1),
        so that destroying the process groups joins their gloo threads
        (``environment.release_at_exit``)."""
        self._groups, self._dp_group, self._tp_group, self._tie_groups, self._zero = [], None, None, [], None

    @property
    def num_stages(self) -> int:
        return self._grid().stages

    @property
    def stage(self) -> int:
        return self._grid().stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self._grid().replica_of(self.global_rank)

    @property
    def data_parallel_world_size(self) -> int:
        return self._grid().replicas

    @property
    def data_parallel_rank(self) -> int:
        return self.replica

    @property
    def replica_world_size(self) -> int:
        """The ranks holding the same parameters as this one: its stage (and tensor index) in
        every replica, what the tensor-parallel checkpoint sums a parameter's pieces over."""
        return self._grid().replicas

    @property
    def replica_rank(self) -> int:
        return self.replica

    @property
    def replica_group(self) -> Any:
        """This stage's (and tensor index's) data-parallel group; None with one replica."""
        return self._dp_group

    def _grid(self) -> PipelineGrid:
        # pure arithmetic on the rank info, so the sampler may ask before setup_environment
        return self.grid or self._grid_of(self.world_size)

    # ------------------------------------------------------------------ model
    def setup_optimizer(self, optimizer: Any) -> None:
        """One optimizer only: the schedule steps every stage's parameters together at the end of
        a batch, so several optimizers stepped at different moments have nothing to map onto."""
        from ...trainer.errors import ConfigError
        from ..optimizers import OptimizerSet

        if isinstance(optimizer, OptimizerSet):
            raise ConfigError(f"strategy='pipeline': {len(optimizer.optimizers)} optimizers given "
                              f"({optimizer!r}); valid: one optimizer (the pipeline schedule runs every "
                              "forward and backward of a batch itself and steps once)")
        super().setup_optimizer(optimizer)
        if self.zero_stage:
            self._zero = StageZero1(optimizer, self.module, self.precision.param_dtype, self.replica,
                                    self._grid().replicas, self._dp_group, self._uncounted())

    # ------------------------------------------------------------------ model
    def configure_model(self, module: nn.Module) -> None:
        module.configure_model()
        plan = plan_of(module) if self.mesh_size("tensor") > 1 else {}  # the plain model's (before to_pipeline)
        pipe = find_pipeline_module(module, self.num_stages)
        if pipe.num_stages != self.num_stages:
            raise ValueError(f"pipeline: the PipelineModule has num_stages={pipe.num_stages} but the strategy "
                             f"runs {self.num_stages} stages (world_size={self.world_size}); make them equal")
        if self.virtual_stages > 1:
            self._cut_chunks(pipe)
        pipe.build(self.stage)
        inside = {id(p) for p in pipe.parameters()}
        stray = [n for n, p in module.named_parameters() if id(p) not in inside]
        if stray:
            raise ValueError(f"pipeline: parameters outside the PipelineModule would sit on every stage and "
                             f"never get a gradient: {stray[:5]}; make them part of a layer")
        self.pipe = pipe
        name = next(n for n, m in module.named_modules() if m is pipe)
        self._pipe_prefix = name + "." if name else ""
        if self.mesh_size("tensor") > 1:
            cut_stage(module, pipe, self._pipe_prefix, plan, self._tp_group, self.mesh_size("tensor"))

    def _cut_chunks(self, pipe: PipelineModule) -> None:
        """Interleaved 1F1B: the layers in stages x virtual_stages chunks."""
        from ...trainer.errors import ConfigError

        if pipe.virtual_stages == self.virtual_stages:  # cut by the user (explicit chunk boundaries)
            return
        try:
            pipe.set_virtual_stages(self.virtual_stages)
        except ValueError as err:
            raise ConfigError(f"pipeline: virtual_stages={self.virtual_stages} with stages={self.num_stages} "
                              f"needs {self.num_stages * self.virtual_stages} chunks of the "
                              f"{pipe.num_layers}-layer PipelineModule: {err}") from None

    def setup_module(self, module: nn.Module) -> None:
        if self.pipe is None:
            self.configure_model(module)
        super().setup_module(module)
        module = self.module
        grid = self._grid()
        self._tie_groups = []
        for tie in self.pipe.ties:  # every rank creates every group, in the same order
            owners = self.pipe.tie_owner_stages(tie)
            if len(owners) < 2:
                continue
            for replica in range(grid.replicas):
                for t in range(grid.tensor):
                    ranks = tuple(grid.tie_ranks(owners, replica, t))
                    group = self._new_group(ranks)
                    if self.global_rank in ranks:
                        self._tie_groups.append(TieGroup(tie, ranks, group, tuple(self.pipe.tied_parameters(tie))))
        if self.distributed:
            for tg in self._tie_groups:
                broadcast_tensors(tg.params, src=tg.ranks[0], group=tg.group)
            if self._dp_group is not None:
                state = list(module.parameters()) + list(module.buffers())
                broadcast_tensors(state, src=grid.rank_of(self.stage, 0, grid.tensor_of(self.global_rank)),
                                  group=self._dp_group)
        comm = None
        if grid.stages > 1 and self.virtual_stages > 1:  # the chunks go round the ring of stages
            comm = PipeComm(grid.ring_prev_rank(self.global_rank), grid.ring_next_rank(self.global_rank), self.device)
        elif grid.stages > 1:
            comm = PipeComm(grid.prev_rank(self.global_rank), grid.next_rank(self.global_rank), self.device)
        self.executor = StageExecutor(self.pipe, grid.stages, comm, self.precision, self.device,
                                      self.run_forward, self.activation_checkpointing)
        # a world collective before the first batched send/receive: NCCL wants its communicator
        # made by a call every rank joins, and a rank that failed set-up is found here, not mid-step
        self.barrier()

    # ------------------------------------------------------------------ the step
    def split_batch(self, batch: Any, train: bool = True) -> tuple[list[Any], list[Any]]:
        """``(inputs, targets)`` -> per-micro-batch lists, split along dim 0 into ``micro_batches``
        parts. A training batch must divide evenly (ConfigError otherwise: the sizes come from the
        configuration, and every micro-batch of a step should weigh the same); an evaluation
        batch need not (a loader's last batch is often short): its first parts get one row more
        (``tensor_split``), fewer parts when it has fewer rows, and each part's loss is weighted
        by its share of the rows, so the result is still the batch's mean loss."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"pipeline: a batch must be (inputs, targets), got {type(batch).__name__}"
                             + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        inputs, targets = batch
        parts = self.micro_batches if train else self._evaluation_parts(batch_rows(inputs, "inputs"))
        return (split_micro_batches(inputs, "inputs", parts, train, self.device),
                split_micro_batches(targets, "targets", parts, train, self.device))

    def _evaluation_parts(self, rows: int) -> int:
        """How many parts an evaluation batch of ``rows`` rows is split into: ``micro_batches``, or
        fewer when it has fewer rows; interleaved (virtual stages) a multiple of the stages, which
        the interleaved order cycles through (``check_interleaved``)."""
        from ...trainer.errors import ConfigError

        parts = max(1, min(self.micro_batches, rows))
        if self.virtual_stages == 1:
            return parts
        p = self._grid().stages
        if rows < p:
            raise ConfigError(f"pipeline: an evaluation batch of {rows} rows with virtual_stages="
                              f"{self.virtual_stages} on stages={p}: the interleaved schedule needs at least "
                              f"one row per stage; valid: evaluation batches of >= {p} rows (drop_last=True), "
                              "or virtual_stages=1")
        return parts - parts % p

    def _instructions(self, train: bool, micro_batches: int) -> list:
        """This stage's instruction list for one batch (training or validation) of
        ``micro_batches`` parts (a short evaluation batch has fewer than configured)."""
        p, m = self._grid().stages, micro_batches
        if self.virtual_stages > 1:
            return interleaved_1f1b(self.stage, p, m, self.virtual_stages, train)
        return (self._schedule if train else inference)(self.stage, p, m)

    def _run(self, batch: Any, train: bool, accumulation: int = 1) -> torch.Tensor:
        micro_inputs, micro_targets = self.split_batch(batch, train)
        return self.run_micro_batches(micro_inputs, micro_targets, train, accumulation)

    def run_micro_batches(self, micro_inputs: list[Any], micro_targets: list[Any], train: bool,
                          accumulation: int = 1) -> torch.Tensor:
        """The schedule over micro-batches given already split (on this rank's device; a stage
        that neither loads inputs nor computes the loss may pass placeholders such as None, one
        per micro-batch): DeepSpeed's ``train_batch`` draws them from an iterator. Returns the
        mean loss over the micro-batches and replicas, the same on every rank."""
        assert self.executor is not None, "pipeline: setup_module() has not run yet"
        with torch.set_grad_enabled(train):
            loss = self.executor.run(self._instructions(train, len(micro_inputs)), micro_inputs, micro_targets,
                                     train=train, grad_scale=1.0 / accumulation)
        return self._mean_over_replicas(loss)

    def _mean_over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage of each replica holds its loss (on every tensor rank of it: tensor rank
        0's counts): sum them over the world (other ranks add 0) and divide by the replicas, so
        every rank returns the same value."""
        if not self.distributed:
            return loss.detach()
        last = self.stage == self.num_stages - 1 and self.mesh_rank("tensor") == 0
        mine = loss.detach().float() if last else torch.zeros((), device=self.device)
        return sum_over_world(mine) / self._grid().replicas

    def run_schedule(self, batch: Any, batch_idx: int, hooks: BatchHooks) -> torch.Tensor:
        """The whole schedule of one batch, every micro-batch's forward and backward; the loss is
        checked through ``hooks.loss_of`` after it (the backward hooks are ``skipped_hooks``)."""
        loss = self._run(batch, train=True, accumulation=hooks.accumulation)
        self.last_step_stats = self.executor.stats
        self.live_activation_peak = max(self.live_activation_peak, self.executor.stats.peak_live)
        return hooks.loss_of(loss)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._run(batch, train=False)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise RuntimeError(_NO_SEPARATE_STEP.format(call="training_step"))

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(_NO_SEPARATE_STEP.format(call="backward"))

    def parameters_for_optimizer(self):
        assert self.module is not None
        return self.module.parameters()

    # ------------------------------------------------------------------ pieces of the step
    # (the sequence is Strategy.optimizer_step)
    def _gradients_ready(self) -> None:
        self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Tied gradients within their tie groups, then all gradients across replicas (ZeRO-1:
        into this replica's partition)."""
        if not self.distributed:
            if self._zero is not None:
                self._zero.reduce()
            return
        for tg in self._tie_groups:
            all_reduce_grads(list(tg.params), tg.group)
        if self._zero is not None:
            self._zero.reduce()
        elif self._dp_group is not None:
            all_reduce_grads(list(self.module.parameters()), self._dp_group,
                             divide_by=self._grid().replicas)

    def _uncounted(self) -> set[int]:
        """``id``s of the parameters whose gradient the global norm counts on another rank: a tied
        weight only on its lowest owning stage, a parameter replicated over the tensor group only
        on its tensor rank 0."""
        tied = {id(p) for tg in self._tie_groups if tg.ranks[0] != self.global_rank for p in tg.params}
        return tied | counted_once(self.module, self.mesh_rank("tensor"))

    def _counted_here(self) -> list[torch.Tensor]:
        """Gradients for the global norm (``norm_stages``: all of a listed stage's, none elsewhere)."""
        if self.norm_stages is not None:  # a listed stage's all, each replicated one once over its tensor group
            if self.stage not in self.norm_stages:
                return []
            once = counted_once(self.module, self.mesh_rank("tensor"))
            return [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in once]
        skip = self._uncounted()
        return [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]

    def _grad_norm(self) -> torch.Tensor:
        """Collective: the global L2 norm over all stages. Replicas hold equal gradients after
        the reduction, so only replica 0 contributes to the one world all-reduce; under ZeRO-1
        each replica holds a different partition, so all contribute."""
        local = torch.zeros((), device=self.device, dtype=torch.float32)
        if self._zero is not None:
            local = self._zero.local_sq_norm(self.device)
        elif self.replica == 0 and (grads := self._counted_here()):
            local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        return (sum_over_world(local) if self.distributed else local).sqrt()

    # ZeRO-1: the step works on this replica's partition of the fp32 masters
    def step_gradients(self) -> list[torch.Tensor]:
        return self._zero.reduce() if self._zero is not None else super().step_gradients()

    def _inner_step(self, loss_scale: float) -> None:
        (self._zero or self.optimizer).step()

    def _refresh_params(self) -> None:
        if self._zero is not None:
            self._zero.refresh()

    def zero_grad(self, which: int | None = None) -> None:
        if self._zero is None:
            return super().zero_grad(which)
        self._zero.zero_grad()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        out = replicated_tensors(self)
        if self._zero is not None:
            out.update(self._zero.memory_tensors())
        return out

    def teardown(self) -> None:
        # The stage, tie and data-parallel groups stay: evaluation and full_state_dict() after
        # fit still communicate. They end with the default group at process exit.
        super().teardown()

    def __repr__(self) -> str:
        grid = f"{self.grid.stages}x{self.grid.replicas}" if self.grid else "unset"
        extra = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        extra += f", zero_stage={self.zero_stage}" if self.zero_stage else ""
        extra += f", tensor_parallel={self.mesh_size('tensor')}" if self.mesh_size("tensor") > 1 else ""
        return (f"PipelineStrategy(stages x replicas={grid}, schedule={self.schedule_name!r}, "
                f"micro_batches={self.micro_batches}{extra})")


# PipelineConfig's fields as keyword parameters of PipelineStrategy(...) for introspection (zerotrain.cli)
expose_options(PipelineStrategy.__init__, PipelineConfig)
