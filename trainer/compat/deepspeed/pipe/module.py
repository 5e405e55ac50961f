"""``deepspeed.pipe.PipelineModule`` on ``strategies.pipeline.PipelineModule``.

DeepSpeed's constructor signature and timing: the module joins the process group (as
``deepspeed.init_distributed`` would; DeepSpeed requires it already), cuts the layers DeepSpeed's
way (``partition.py``) and builds this rank's stage at once, so ``model.parameters()`` before
``deepspeed.initialize`` are this stage's, as the scripts pass them as ``model_parameters``.
Ranks map to stages as the pipeline strategy lays them out (``PipelineGrid``: stage-fastest);
DeepSpeed lays replicas fastest. With one replica (world = stages) both give rank ``s`` stage
``s``; with several, a rank may hold another (stage, replica) than under DeepSpeed, which changes
which process computes what but not the results.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ....errors import ConfigError
from .....strategies.pipeline.module import PipelineModule as _Pipeline
from .....strategies.pipeline.topology import PipelineGrid
from .. import comm
from .partition import boundaries


def _refuse(name: str, value: Any, valid: str) -> None:
    raise ConfigError(f"PipelineModule: {name}={value!r}; valid: {valid}")


class PipelineModule(_Pipeline):
    """DeepSpeed's ``PipelineModule(layers, num_stages, loss_fn=..., partition_method=...,
    activation_checkpoint_interval=...)``: see the module docstring."""

    def __init__(self, layers: Iterable[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] | None = None,
                 checkpointable_layers: Any = None, dynamic_shape: bool = False) -> None:
        if topology is not None:
            _refuse("topology", topology, "None, with num_stages (stages x data-parallel replicas)")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            _refuse("num_stages", num_stages, "an integer >= 1 that divides the world size")
        if seed_layers:
            _refuse("seed_layers", seed_layers, "False (layers are built from the global random state)")
        if isinstance(activation_checkpoint_interval, bool) or not isinstance(activation_checkpoint_interval, int) \
                or activation_checkpoint_interval < 0:
            _refuse("activation_checkpoint_interval", activation_checkpoint_interval,
                    "an integer >= 0 (0: off; any other value recomputes each stage's forward in its backward)")
        if activation_checkpoint_func is not None or checkpointable_layers is not None:
            _refuse("activation_checkpoint_func/checkpointable_layers",
                    (activation_checkpoint_func, checkpointable_layers), "None (the whole stage is recomputed)")
        layers = list(layers)
        if not dist.is_initialized():
            comm.init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % num_stages:
            _refuse("num_stages", num_stages, f"a divisor of the world size {world} (world = stages x "
                    "data-parallel replicas)")
        bounds = boundaries(layers, num_stages, partition_method)
        super().__init__(layers, num_stages, bounds, loss_fn)
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.dynamic_shape = bool(dynamic_shape)
        self.build(PipelineGrid(world, num_stages).stage_of(rank))

    def configure_model(self) -> None:
        """The strategy's build hook: the stage was built at construction."""

    @property
    def parts(self) -> list[int]:
        """DeepSpeed's name for the stage boundaries."""
        return list(self.bounds)

    @property
    def stage_id(self) -> int:
        return self.stage


__all__ = ["PipelineModule"]
