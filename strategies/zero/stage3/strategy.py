"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned over the ranks.

Pieces (one object per level, as FSDP2): ``unit_plan`` decides which parameters are communicated
together (one unit per transformer block by default, a root unit for the rest, small parameters
optionally kept whole); ``unit.Unit`` is one unit's shards and its SHARDED / GATHERING / UNSHARDED
state machine; ``runtime.Stage3Runtime`` says what happens at each forward/backward event
(gather, prefetch, free, reduce); ``hooks.Stage3Hooks`` installs every hook (``hooks.py`` holds
every stage's); ``materialize.PartitionedBuild`` builds the model partitioned in
``configure_model()``; gathers and reductions in flight are entries of the strategy's in-flight
layer (``comm/inflight.py``). This class wires them into the Strategy interface and reuses ZeRO-1/2's
step, clipping and overflow handling.

Set-up (the Trainer's order):

* ``configure_model`` (``init_context``): ``TrainModule.configure_model()`` - or the Engine's
  ``init_module()`` block - runs inside ``PartitionedBuild``; a model built there is never whole on
  any rank and equals an eager build with the same seed.
* ``setup_module``: with a tensor axis, cut the module by its plan first (each rank's shards are
  then ordinary parameters, partitioned over the replicas: ``replica_group``); plan the units; move each unit's values (from the partitioned build, or from
  rank 0's eagerly built parameters) into its shards, one unit at a time; install the hooks.
* ``setup_optimizer``: the user's optimizer is re-targeted onto views of the units' fp32 masters
  (one run of one param group at a time, ``unit_plan.optimizer_runs``).

A step: forward and backward gather units just in time (hooks); each unit's gradients are reduced
right after its backward into the rank's gradient partition (every micro-batch, as ZeRO-2); then
``Strategy.optimizer_step`` with ZeRO's pieces: unscale/overflow, clip (per-parameter norms as
PyTorch's, ``grad_norm.py``), the inner optimizer on the master views, and ``_refresh_params``, which here only
refreshes the working shards (and re-gathers the persistent small parameters). Nothing is gathered
between steps.

Checkpoints: the Trainer's strategy-neutral format (``param_shards`` / ``load_param_shards``, in
``checkpoint``) saves each rank's element ranges of the units' masters with their optimizer
state and loads into any strategy and world size; ``full_state_dict()`` gathers unit by unit into
rank 0.

Memory per rank between steps: 16Psi/N with Adam in bf16-mixed (2 working shard + 2 gradient with
``reduce_dtype="bf16"`` + 4 master + 8 Adam), plus the persistent parameters whole; during a step
at most ``max_live_parameters`` gathered elements plus the unit in use.

Outside a step a sharded parameter reads as NaN (a placeholder of the right shape): read weights
with ``full_state_dict()`` or inside ``with strategy.gathered(module):``. During a step, a
parameter used outside its unit's forward is gathered on demand (see ``hooks.py``). After ``fit``
the hooks stay, so evaluation and ``model.generate()`` keep working; ``remove_hooks()`` drops them.
A unit that did not run in a step gets zero gradients (ZeRO keeps a gradient for every element;
plain PyTorch would skip the parameter), so Adam's momentum and weight decay still move it.

Not supported: optimizers that are not element-wise (see ``sharded_optimizer``); control flow
that differs between ranks (units would be gathered in different orders, as with FSDP); the
"-true" precisions keep buffers in fp32 (working parameters are in ``param_dtype`` as usual).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch
from torch import nn

from ...optimizers import refuse_shared
from ...step_wrapper import StepWrapper
from ...environment import release_at_exit
from ...memory.host import free_bytes_per_rank
from ... import partitioned
from ...parallel.tensor_checkpoint import TensorAxis
from ...parallel.tensor_plan import cut_for_mesh
from ..comm.collectives import backend, broadcast_from, least_over_ranks, new_group, world_size
from ..comm.grad_norm import ParamNorm, plan_param
from ..hooks import Stage3Hooks
from ..layout import build_layout
from .materialize import PartitionedBuild
from ..comm.quantized import Quantization
from ..sharded_optimizer import ShardedOptimizer
from .checkpoint import Stage3Checkpoint
from .experts import experts_norm_sq, refuse_with_experts, unit_group
from .runtime import RuntimeOptions, Stage3Runtime
from ..strategy import ZeroStrategy, trainable_groups
from .unit import Unit
from .unit_plan import PERSISTENT, ROOT, UnitPlan, make_policy, optimizer_runs, plan_units

log = logging.getLogger("zerotrain")


class ZeroStage3(ZeroStrategy):
    """ZeRO-3: every rank keeps 1/N of the parameters; units are gathered just in time."""

    name = "zero3"
    stage = 3
    partitions_parameters = True
    #: with a tensor axis, tensor-parallel parameters saved whole and loaded cut (parallel/tensor_checkpoint.py)
    checkpoint_adapter = TensorAxis(Stage3Checkpoint)
    #: expert parameters (moe/) get units of their own over their expert-data-parallel group
    #: (``experts.py``), so ``optimizers.refuse_shared`` lets expert-parallel models through
    reduces_expert_gradients = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan: UnitPlan | None = None
        self.units: list[Unit] = []
        #: how ``max_reuse_distance`` was resolved at set-up (for logs and reports)
        self.reuse_source = "given"
        self.runtime: Stage3Runtime | None = None
        self.hooks: Stage3Hooks | None = None
        self._build: PartitionedBuild | None = None
        self._quant: Quantization | None = None
        #: (unit, run, master view): what the optimizer steps, in its order
        self._runs: list[tuple[Unit, Any, torch.Tensor]] = []
        self._group_of: dict[int, int] = {}  # id(param) -> optimizer param group

    # ------------------------------------------------------------------ set-up
    @contextlib.contextmanager
    def init_context(self) -> Iterator[None]:
        """Parameters created inside are partitioned as they are registered (``PartitionedBuild``);
        ``setup_module`` then moves them into their units without gathering any model whole."""
        build = PartitionedBuild(self.replica_rank, self.replica_world_size, self.group, self.queue,
                                 self.stepper.build_chunks(self.global_rank))
        with build:
            yield
        self._build = build if build.params else None

    def setup_module(self, module: nn.Module) -> None:
        partitioned.refuse_other(module, self)
        self.check_precision(self.precision, type(self.precision).__name__)
        meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        if meta:
            raise ValueError(f"zero3: parameters {meta[:5]} are on the meta device; build the model in "
                             "TrainModule.configure_model() on the CPU (zero3 partitions it as it is "
                             "built) or eagerly in __init__")
        self.module = module
        if self._build is not None and self.mesh_size("tensor") > 1:
            raise ValueError(f"zero3: tensor_parallel={self.mesh_size('tensor')} with a model built partitioned "
                             "(configure_model(), Engine.init_module(), deepspeed.zero.Init: never whole, so not "
                             "cut); valid: build it eagerly (in __init__)")
        cut_for_mesh(self)  # a tensor axis: each rank's shards (parallel/tensor_plan.py) are what the units hold
        self.plan = plan_units(module, make_policy(self.stage3.unit_modules),
                               self.stage3.param_persistence_threshold)
        named = dict(module.named_parameters(remove_duplicate=False))
        if self.mesh_size("tensor") > 1 and any(spec.kind for spec in self.plan.units):
            raise ValueError(f"zero3: expert-parallel parameters (moe/, ep_size > 1) with tensor_parallel="
                             f"{self.mesh_size('tensor')} are not built yet; valid: tensor_parallel=1, or ep_size=1")
        if self.offload is not None and any(spec.kind for spec in self.plan.units):
            raise ValueError("zero3: offload with expert-parallel parameters (moe/, ep_size > 1) is not built "
                             "yet (issue 46); valid: zero3 without offload, or ep_size=1")
        for spec in self.plan.units:
            self.units.append(self._build_unit(len(self.units), spec.name, spec.params,
                                               [named[n] for n in spec.params], spec.kind))
        if self._build is not None:
            self._build.release()
            self._build = None
        if self.stage3.hierarchical_partition:
            refuse_with_experts(self.units, "hierarchical_partition=True", "hierarchical_partition=False")
            self._enable_secondary()
        managed = {id(p) for u in self.units for p in u.params}
        with torch.no_grad():
            for t in [*module.buffers(), *(p for p in module.parameters() if id(p) not in managed)]:
                t.data = t.data.to(self.device)
        self.model = StepWrapper(module, self.step_call)
        self.reduce_mode = self.config.resolved_reduce_mode(backend(self.group), world_size(self.group),
                                                            even_pieces=True)
        options = RuntimeOptions(self.stage3.reshard_after_forward, self.stage3.prefetch_bucket_size,
                                 self.stage3.max_live_parameters, self.reduce_mode, self._reuse_distance())
        self.runtime = Stage3Runtime(self.units, options, self.queue, self.config.torch_reduce_dtype,
                                     self.group)
        units = [(u, module.get_submodule(u.name)) for u in self.units if u.name not in (ROOT, PERSISTENT)]
        self.hooks = Stage3Hooks(self.runtime, units, [self.model, *self._scope_modules()],
                                 self.stage3.activation_checkpointing)
        partitioned.mark(module, self)

    def compile_blocks(self) -> list[nn.Module] | None:
        """Each unit's module (its gather and release hooks stay outside the compiled forward)."""
        assert self.module is not None and self.plan is not None
        return [self.module.get_submodule(u.name) for u in self.units if u.name not in (ROOT, PERSISTENT)] or None

    def compile_module(self) -> None:
        """As the base's; each compiled region runs outside the parameter-touch watch (which dynamo
        would trace, guarding on every input's identity: a recompilation per step), so a unit's
        compiled forward must read only its own (gathered) and the persistent parameters."""
        if self.compile is not None and self.compiled is None and self.hooks is not None:
            from ...compile import compile_regions
            self.compiled = compile_regions(self.module, self.compile, self.compile_blocks(),
                                            around=self.hooks.outside_watch)
            self.hooks.drop_inner_scopes(self.compiled.modules)

    def _reuse_distance(self) -> int:
        """Collective for "auto": ``max_reuse_distance`` in elements, from what each rank has free
        now that its shards exist (``Stage3Config.reuse_budget``), the least over ranks so that
        every rank keeps the same units; 0 under offload (its point is to hold less)."""
        if self.stage3.max_reuse_distance != "auto":
            return int(self.stage3.max_reuse_distance)
        if self.offload is not None:
            self.reuse_source = "auto: 0 under offload"
            return 0
        free = free_bytes_per_rank(self.device, self.info.local_world_size)
        shard = sum(u.hi - u.lo for u in self.units if not u.persistent)
        size = torch.empty((), dtype=self.precision.param_dtype).element_size()
        budget = least_over_ranks(self.stage3.reuse_budget(free, shard, size), self.device, self.group)
        self.reuse_source = f"auto: {budget} elements from {free / 2**30:.1f} GiB free on this rank"
        if self.is_global_zero:
            log.info("zero3: max_reuse_distance=%s (the least over ranks)", self.reuse_source)
        return budget

    def _build_unit(self, index: int, name: str, names: tuple[str, ...], params: list[nn.Parameter],
                    kind: str | None = None) -> Unit:
        """Collective: lay out one unit and move its values into this rank's shards; the unit's
        full values exist only here, once, in fp32. An expert unit (``kind``, ``experts.py``) is
        laid out over its expert-data-parallel group and takes that group's first rank's values."""
        where = unit_group(kind, self.replica_world_size, self.replica_rank, self.group)
        layout = build_layout([p.numel() for p in params], where.size, self.config.partition_alignment)
        build = self._build
        adopted = [build is not None and build.owns(p) for p in params]
        if kind is not None and any(adopted):
            raise ValueError(f"zero3: expert parameters of unit {name!r} were built in configure_model() (partitioned "
                             "over the world); valid: build expert-parallel layers eagerly (in __init__)")
        slack = max([self.replica_world_size * build.chunk_of(p) - p.numel() for p, a in zip(params, adopted) if a]
                    or [0])
        flat = torch.empty(layout.padded_numel + slack, dtype=torch.float32, device=self.device)
        for p, span, a in zip(params, layout.spans, adopted):  # in order: a gather's tail is overwritten
            if a:
                build.take(p, flat[span.offset:])
            else:
                flat[span.offset:span.end].copy_(p.detach().reshape(-1))
        flat[layout.numel:].zero_()
        if not all(adopted) and layout.padded_numel:  # eager parameters: rank 0's values, as DDP
            self.queue.complete(broadcast_from(flat[:layout.padded_numel], where.source, where.group), flat,
                                label="broadcast unit")
        unit = Unit(index, name, params, names, layout, where.rank, self.precision.param_dtype,
                    self.config.torch_reduce_dtype, self.device, persistent=name == PERSISTENT,
                    inflight=self.queue, quant=self._quantization())
        if kind is not None:
            unit.use_group(where.group, self.replica_world_size)
        if self.config.master_dtype != "fp32":  # checked: the working dtype
            unit.master_in_working()
        unit.load_full(flat)
        self.stepper.place_unit(unit, self.global_rank)  # offload: shards to files, unit by unit
        return unit

    def _enable_secondary(self) -> None:
        """Collective (hpZ): one process group per node (every rank creates every group, in the
        same order), and each unit's node copy."""
        world, local = self.world_size, max(1, self.info.local_world_size)
        if self.replica_world_size != world:
            raise ValueError(f"zero3: hierarchical_partition=True with a tensor axis (mesh {self.mesh}); valid: "
                             "hierarchical_partition=False")
        if world % local:
            raise ValueError(f"zero3: hierarchical_partition=True with local_world_size={local}: world_size="
                             f"{world} is not a multiple of it; valid: nodes with equal numbers of ranks")
        node_group = self.group
        if local < world:
            for node in range(world // local):
                g = new_group(list(range(node * local, (node + 1) * local)))
                node_group = g if node == self.global_rank // local else node_group
            release_at_exit(self)
        for u in self.units:
            u.enable_secondary(self.global_rank % local, local, node_group)

    def release_at_exit(self) -> None:
        """Interpreter exit: the units let go of hpZ's node subgroup, so that destroying the
        process groups joins its gloo threads (``environment.release_at_exit``)."""
        for u in self.units:
            u.node_group = None

    def _quantization(self) -> Quantization:
        """ZeRO++'s options as the units use them (``comm/quantized.py``): one instance, so that every
        unit's collectives share one pool of int8 buffers."""
        if self._quant is None:
            self._quant = Quantization(self.stage3.quantize_weights, self.config.quantize_gradients,
                                       self.config.quantize_block_size)
        return self._quant

    def _scope_modules(self) -> list[nn.Module]:
        """The TrainModule and every module holding a root-unit parameter, with their ancestors:
        whichever of them is called first gathers the root for its forward."""
        root = next((u for u in self.units if u.name == ROOT), None)
        paths = {ROOT}
        if root is not None:
            canonical = set(root.names)
            for alias, name in self.plan.aliases.items():
                if name in canonical:
                    parts = alias.split(".")[:-1]
                    paths.update(".".join(parts[:i]) for i in range(len(parts) + 1))
        return [self.module.get_submodule(p) for p in sorted(paths, key=lambda s: (s.count("."), s))]

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.runtime is not None, "setup_module must run before setup_optimizer"
        refuse_shared(self, optimizer)
        self.stepper.check(self.stage, self.device, optimizer, self.precision)
        groups = trainable_groups(optimizer, self.module)
        group_of = {id(p): gi for gi, ps in enumerate(groups) for p in ps}
        masters: list[list[torch.Tensor]] = [[] for _ in groups]
        grads: list[list[torch.Tensor]] = [[] for _ in groups]
        for u in self.units:
            runs = optimizer_runs(u.layout, u.rank, [group_of.get(id(p)) for p in u.params])
            for r in runs:
                masters[r.group].append(u.master[r.start:r.start + r.numel])
                grads[r.group].append(u.grad[r.start:r.start + r.numel])
                self._runs.append((u, r, masters[r.group][-1]))
        self._group_of = group_of
        self.optimizer = optimizer
        self.runtime.grad_views = [g for gs in grads for g in gs]
        self.grads = self.runtime
        order = [(u, r) for g in range(len(groups)) for u, r, _ in self._runs if r.group == g]
        self._norm_sources = (groups, order)
        self.stepper.page_units([(u, r.start) for u, r in order])  # the masters' order: group by group
        self._attach_stepper(ShardedOptimizer(optimizer, masters),
                             [u.working[r.start:r.start + r.numel] for u, r in order], masters_external=True)

    def master_pieces(self) -> tuple[list[list[nn.Parameter]], list[list[tuple[nn.Parameter, int, int, int]]]]:
        """After ``setup_optimizer``: the optimizer's trainable parameters, group by group in its
        order, and what each master slot (the optimizer's params from then on, group by group; an
        offload stepper's slots) holds: ``(parameter, first element in the parameter, first element
        in the slot, count)`` per piece, in slot order."""
        groups, order = self._norm_sources
        slots = []
        for u, r in order:
            base = u.lo + r.start
            pieces = []
            for s in u.layout.spans:
                lo, hi = max(s.offset, base), min(s.end, base + r.numel)
                if lo < hi:
                    pieces.append((u.params[s.index], lo - s.offset, lo - base, hi - lo))
            slots.append(pieces)
        return [list(g) for g in groups], slots

    def _plan_norms(self) -> list[ParamNorm]:
        """Each trainable parameter in the optimizer's order, located in its unit's partition
        (the master slots are the optimizer runs, group by group)."""
        groups, order = self._norm_sources
        slots: dict[int, list[tuple[int, Any]]] = {}
        for k, (u, r) in enumerate(order):
            slots.setdefault(id(u), []).append((k, r))
        where = {id(p): (u, i) for u in self.units for i, p in enumerate(u.params)}

        def locate(u: Unit) -> Any:
            def at(start: int) -> tuple[int, int]:
                k, r = next((k, r) for k, r in slots[id(u)] if r.start <= start < r.start + r.numel)
                return k, start - r.start
            return at
        return [dataclasses.replace(plan_param(gi, p.shape, where[id(p)][0].layout, where[id(p)][1],
                                               where[id(p)][0].rank, locate(where[id(p)][0])),
                                    tensor_parallel=hasattr(p, "tensor_parallel"))  # a shard: summed over tp
                for gi, ps in enumerate(groups) for p in ps if not where[id(p)][0].has_own_group]  # experts: ``_grad_norm``

    def _grad_norm(self) -> torch.Tensor:
        """The dense parameters' norm as ZeRO-1/2 take it (``_plan_norms`` leaves experts out),
        joined with the experts' sum of squares (``experts.py``)."""
        dense = super()._grad_norm()
        if not any(u.has_own_group for u in self.units):
            return dense
        if self._step_groups is not None or self.stepper.norm_factor() != 1.0:
            raise ValueError("zero3: clipping one optimizer's groups, or with a loss-scaled stepper, with "
                             "expert-parallel units is not built yet (issue 46); valid: one optimizer, "
                             "fp32/bf16 precision")
        experts = experts_norm_sq(self.units, self.device, lambda h, t, label: self.queue.complete(h, t, label=label),
                                  self.group)
        return torch.sqrt(dense.float() ** 2 + experts)

    def _extra_state_names(self) -> list[str]:
        """State-dict entries that no unit holds: buffers and non-floating-point parameters."""
        managed = set(self.plan.aliases) if self.plan is not None else set()
        return [k for k in self.module.state_dict() if k not in managed]

    @contextlib.contextmanager
    def gathered(self, module: nn.Module | None = None) -> Iterator[None]:
        """Collective: inside, the parameters of ``module`` (default: the whole model) hold their
        full values, e.g. to inspect or export weights between steps. Read-only: changes are not
        written back (the masters are). Outside a step only."""
        wanted = {id(p) for p in (module or self.module).parameters()}
        units = [u for u in self.units if any(id(p) in wanted for p in u.params)]
        self.runtime.hold(units)
        try:
            yield
        finally:
            self.runtime.free_all()

    # ------------------------------------------------------------------ the step
    def _refresh_params(self) -> None:
        """After the inner step: nothing is gathered between steps; refresh the working shards
        from the masters (and all-gather the persistent parameters)."""
        self.stepper.before_refresh(self.sharded)
        self.runtime.free_all()
        copy = not self.stepper.took_working()
        for u in self.units:
            u.refresh(self.group, copy=copy)

    # ------------------------------------------------------------------ memory and end
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        managed = {id(p) for u in self.units for p in u.params}
        out = {"params": [t for u in self.units for t in (u.working, u.full)]
               + [p for p in self.module.parameters() if id(p) not in managed],
               "grads": [u.grad for u in self.units],
               "master": [u.master for u in self.units],
               "optimizer": self.sharded.state_tensors() if self.sharded else [],
               "comm_buffers": self.runtime.comm_buffers() if self.runtime else []}
        self.stepper.adjust_memory(out, self.sharded)
        return out

    def _model_numel(self) -> int:
        return sum(u.layout.numel for u in self.units)

    def _grad_bytes_per_param(self) -> int:
        return self.config.torch_reduce_dtype.itemsize

    def teardown(self) -> None:
        """End of fit: reductions finish, every unit is freed; the hooks stay, so the model keeps
        working for evaluation and sampling (``remove_hooks()`` takes them away)."""
        super().teardown()

    def stall_hint(self) -> str:
        return ("under zero3 every forward gathers parameters collectively, so every rank must run it: "
                "a forward on one rank only (a callback that samples or evaluates under "
                "`if trainer.is_global_zero:`) waits for gathers the other ranks never join. Run it on "
                "every rank and keep only rank 0's output.")

    def remove_hooks(self) -> None:
        """Uninstall every ZeRO-3 hook. Parameters stay sharded placeholders: read weights with
        ``full_state_dict()``."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, {self.spec.options()}, {self.stepper})"
