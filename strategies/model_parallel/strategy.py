"""``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)``: Lightning's strategy of that
name on zerotrain's Trainer. The user parallelizes the model with torch's own APIs in
``configure_model`` (``parallelize_module`` on ``self.device_mesh["tensor_parallel"]``, FSDP2's
``fully_shard`` on ``self.device_mesh["data_parallel"]``); the strategy lends them the mesh and
trains the DTensor module they make, as it is.

In the Trainer's order (``strategies/base.py``):

- ``check_world_size``: the two sizes against the process count, before any rank starts (an int
  as given; ``"auto"`` what the other leaves; both ``"auto"``: the ranks of one node along the
  tensor axis, the nodes along the data axis, as Lightning).
- ``setup_environment``: joins the process group (one process: a group of one, since the mesh
  needs one) and builds torch's ``DeviceMesh`` of shape (data, tensor) with Lightning's dimension
  names, ``strategy.device_mesh``. Its rank order is ``parallel.ParallelMesh(data, tensor)``'s
  (row-major), which the strategy keeps as ``mesh``: the loaders shard by the data axis only, so the
  ranks of a tensor-parallel group see the same batches.
- ``configure_model``: refuses a module without its own ``configure_model`` (where else would the
  plans run), lends the module the mesh (``TrainModule.device_mesh``) and runs it; FSDP1 modules
  (``FullyShardedDataParallel``) are refused after it.
- ``setup_module``: what was built on the meta device is materialized (``to_empty``, then each
  submodule's ``reset_parameters``; a warning names the modules without one), then cast, moved
  and wrapped for the step as by the base. zerotrain wraps and reduces nothing: the plans are the
  parallelism (DTensor's collectives in forward and backward, FSDP2's gradient reduce-scatter over
  the data axis). With a data axis and no FSDP2 module, the data-parallel ranks' gradients are not
  averaged by anyone: a warning says so.
- the step is the base's ``optimizer.step()`` on the DTensor parameters. Clipping by norm takes
  each gradient's norm whole (a sharded gradient's norm is a partial DTensor, reduced by
  ``full_tensor``) and combines them as ``clip_grad_norm_`` does; the coefficient scales each
  rank's local shards.
- checkpoints: ``checkpoint.py`` (the reshardable format, DTensors gathered whole).
"""
from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base import PROCESS_GROUP_TIMEOUT_S, Strategy
from ..environment import default_backend, init_default_group, init_process_group
from ..memory import replicated_tensors
from ..parallel.mesh import ParallelMesh
from .checkpoint import DTensorCheckpoint, full_value, local_tensor

#: the mesh's dimension names, Lightning's (``device_mesh["data_parallel"]``, ``["tensor_parallel"]``)
MESH_DIMS = ("data_parallel", "tensor_parallel")
#: the precisions whose plugin steps DTensor gradients as they are (16-mixed's loss scaler is not built for them)
PRECISIONS = ("32", "bf16-mixed", "bf16-true")


def _size(option: str, value: Any) -> "int | str":
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelParallelStrategy: {option}={value!r}; valid: 'auto' or a whole number >= 1")
    return value


def mesh_shape(data: "int | str", tensor: "int | str", world_size: int, per_node: int | None = None) -> tuple[int, int]:
    """(data, tensor) for ``world_size`` ranks. ``per_node`` (ranks on one node) resolves both
    ``"auto"``; without it, both ``"auto"`` is (1, world_size). ValueError naming the sizes where
    their product is not the process count."""
    if data == "auto" and tensor == "auto":
        tensor = per_node or world_size
        data = world_size // tensor
    elif data == "auto" or tensor == "auto":
        given = tensor if data == "auto" else data
        other = world_size // given if world_size % given == 0 else 0
        data, tensor = (other, given) if data == "auto" else (given, other)
    if data * tensor != world_size:
        raise ValueError(f"ModelParallelStrategy: data_parallel_size={data or 'auto'} x tensor_parallel_size="
                         f"{tensor or 'auto'} does not make the job's {world_size} processes (devices x num_nodes); "
                         "valid: sizes whose product is the process count, or 'auto' for one of them")
    return data, tensor


def _overrides_configure_model(module: nn.Module) -> bool:
    owner = next((k for k in type(module).__mro__ if "configure_model" in vars(k)), None)
    return owner is not None and not (owner.__name__ == "TrainModule" and owner.__module__.endswith("api.module"))


def materialize(module: nn.Module, device: torch.device) -> None:
    """A module built (partly) on the meta device: each submodule holding meta tensors of its own
    gets storage on ``device`` (``to_empty``, that submodule alone) and is re-initialized by its
    ``reset_parameters``; submodules with real tensors keep them. A warning names the modules that
    have no ``reset_parameters`` (their tensors are left uninitialized)."""
    missing = set()
    for sub in module.modules():
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue
        sub.to_empty(device=device, recurse=False)
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missing.add(type(sub).__name__)
    if missing:
        warnings.warn(f"ModelParallelStrategy: the module was built on the meta device and {', '.join(sorted(missing))} "
                      "has no reset_parameters(): its tensors were given memory but no values; define "
                      "reset_parameters() on it, or build the module off the meta device", UserWarning, stacklevel=3)


def refuse_fsdp1(module: nn.Module) -> None:
    """TypeError where the user's parallelization wrapped a module in FSDP1 (FSDP2 only here)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    old = [n or type(module).__name__ for n, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if old:
        raise TypeError(f"ModelParallelStrategy: {old[0]} is wrapped in FullyShardedDataParallel (FSDP1); valid: "
                        "torch's fully_shard (FSDP2) on the mesh's 'data_parallel' dimension")


class ModelParallelStrategy(Strategy):
    """Lightning's ``ModelParallelStrategy``: the user's torch tensor parallelism and FSDP2 on a
    (data, tensor) device mesh. Options: ``data_parallel_size`` / ``tensor_parallel_size``
    (``"auto"`` or an int), ``save_distributed_checkpoint`` (True only: zerotrain writes its own
    sharded checkpoint directory, ``checkpoint.py``), ``process_group_backend`` (None, or the
    device's: "gloo" on CPU, "nccl" on CUDA), ``timeout`` (a ``timedelta`` or seconds)."""

    name = "model_parallel"
    #: the mesh is torch's, built here (``setup_environment``): none of zerotrain's own axes
    mesh_axes: tuple[str, ...] = ()
    evaluates_without_optimizer = True
    checkpoint_adapter = DTensorCheckpoint
    #: ``Trainer.init_module(empty_init=True)`` builds on the meta device: ``setup_module`` materializes
    meta_init = True
    #: Lightning's sampler rule: on several processes every loader gets a DistributedSampler over the
    #: data axis (training: shuffled), even with one data-parallel replica (tensor parallelism alone)
    lightning_sampler = True

    def __init__(self, data_parallel_size: "int | str" = "auto", tensor_parallel_size: "int | str" = "auto",
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: "datetime.timedelta | float | None" = None) -> None:
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        super().__init__(PROCESS_GROUP_TIMEOUT_S if timeout is None else timeout)
        self.data_parallel_size = _size("data_parallel_size", data_parallel_size)
        self.tensor_parallel_size = _size("tensor_parallel_size", tensor_parallel_size)
        if save_distributed_checkpoint is not True:
            raise ValueError(f"ModelParallelStrategy: save_distributed_checkpoint={save_distributed_checkpoint!r}; "
                             "valid: True (zerotrain writes its own reshardable checkpoint directory; for one file of "
                             "the whole weights use trainer.strategy.full_state_dict())")
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"ModelParallelStrategy: process_group_backend={process_group_backend!r}; valid: None, "
                             "'gloo' (CPU), 'nccl' (CUDA)")
        self.process_group_backend = process_group_backend
        self._device_mesh: Any = None

    # ------------------------------------------------------------------ the mesh
    @property
    def device_mesh(self) -> Any:
        """torch's ``DeviceMesh`` (dimensions ``"data_parallel"``, ``"tensor_parallel"``); a
        RuntimeError before ``setup_environment`` has joined the processes."""
        if self._device_mesh is None:
            raise RuntimeError("ModelParallelStrategy.device_mesh: the mesh exists once the processes have joined "
                               "(Trainer set-up); use it in configure_model() or later")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Lightning's: the loaders' share, by the data axis only."""
        return {"num_replicas": self.data_parallel_world_size, "rank": self.data_parallel_rank}

    def check_world_size(self, world_size: int) -> None:
        super().check_world_size(world_size)
        if (self.data_parallel_size, self.tensor_parallel_size) != ("auto", "auto"):  # both: any world
            mesh_shape(self.data_parallel_size, self.tensor_parallel_size, world_size)

    def check_precision(self, precision: Any, name: str) -> None:
        if precision.name not in PRECISIONS:
            raise ValueError(f"ModelParallelStrategy: precision={name!r}; valid: {', '.join(PRECISIONS)} (FSDP2's "
                             "MixedPrecisionPolicy in configure_model for more)")

    def setup_environment(self) -> None:
        backend = default_backend(self.device)
        if self.process_group_backend not in (None, backend):
            raise ValueError(f"ModelParallelStrategy: process_group_backend={self.process_group_backend!r} on a "
                             f"{self.device.type} device; valid: {backend!r} or None")
        if self.world_size == 1 and not dist.is_initialized():  # the mesh needs a group, of one here
            init_default_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            init_process_group(self.info, self.device, self.process_group_timeout_s)
        data, tensor = mesh_shape(self.data_parallel_size, self.tensor_parallel_size, self.world_size,
                                  self.info.local_world_size)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = ParallelMesh(data=data, tensor=tensor)  # the same rank order as torch's row-major mesh
        self._device_mesh = init_device_mesh(self.device.type, (data, tensor), mesh_dim_names=MESH_DIMS)

    # ------------------------------------------------------------------ the model
    def configure_model(self, module: nn.Module) -> None:
        if not _overrides_configure_model(module):
            raise TypeError(f"ModelParallelStrategy: {type(module).__name__} does not override configure_model(); "
                            "parallelize the model there (parallelize_module / fully_shard on self.device_mesh)")
        if isinstance(getattr(type(module), "device_mesh", None), property):
            module.device_mesh = self.device_mesh
        super().configure_model(module)
        refuse_fsdp1(module)

    def setup_module(self, module: nn.Module) -> None:
        materialize(module, self.device)
        from torch.distributed.fsdp import FSDPModule

        if self.mesh_size("data") > 1 and not any(isinstance(m, FSDPModule) for m in module.modules()):
            warnings.warn(f"ModelParallelStrategy: data_parallel_size={self.mesh_size('data')} but configure_model() "
                          "applied no fully_shard (FSDP2) on the data axis: nothing averages the data-parallel ranks' "
                          "gradients, so their weights drift apart", UserWarning, stacklevel=2)
        super().setup_module(module)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds (``memory.count_bytes``): each DTensor's local shard."""
        return {cat: [local_tensor(t) for t in ts] for cat, ts in replicated_tensors(self).items()}

    # ------------------------------------------------------------------ clipping on DTensor gradients
    def _grad_norm(self) -> torch.Tensor:
        """The gradients' global L2 norm: each one's norm whole (a shard's is reduced over its
        mesh), then the norm of those, as ``clip_grad_norm_``; collective, every rank alike."""
        norms = [full_value(torch.linalg.vector_norm(g.detach().float(), 2.0)) for g in self.step_gradients()]
        if not norms:
            return torch.zeros((), device=self.device)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def _scale_grads(self, coef: torch.Tensor) -> None:
        for g in self.step_gradients():
            local = local_tensor(g.detach())
            local.mul_(coef.to(local.dtype))

    def __repr__(self) -> str:
        return (f"ModelParallelStrategy(data_parallel_size={self.data_parallel_size!r}, "
                f"tensor_parallel_size={self.tensor_parallel_size!r})")


class FabricModelParallelStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy(parallelize_fn, ...)`` (``zerotrain.fabric.strategies``):
    ``Fabric.setup(model)`` first calls ``parallelize_fn(model, device_mesh)``, the user's torch calls
    (no ``configure_model`` under Fabric), then sets the module up as above. The function must
    parallelize in place and return the module it was given (``parallelize_module`` and
    ``fully_shard`` do): the Engine hands back a wrapper of that module."""

    def __init__(self, parallelize_fn: Any, data_parallel_size: "int | str" = "auto",
                 tensor_parallel_size: "int | str" = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: "datetime.timedelta | float | None" = None) -> None:
        if not callable(parallelize_fn):
            raise TypeError(f"ModelParallelStrategy: parallelize_fn={parallelize_fn!r}; valid: a function "
                            "(module, device_mesh) -> the module, parallelized in place")
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend,
                         timeout)
        self.parallelize_fn = parallelize_fn

    def setup_module(self, module: nn.Module) -> None:
        out = self.parallelize_fn(module, self.device_mesh)
        if out is not module:
            raise TypeError(f"ModelParallelStrategy: parallelize_fn returned {type(out).__name__}, not the module it "
                            "was given; valid: parallelize in place (parallelize_module / fully_shard do) and return it")
        refuse_fsdp1(module)
        super().setup_module(module)
