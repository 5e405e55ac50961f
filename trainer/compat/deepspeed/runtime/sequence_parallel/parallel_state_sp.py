"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: the sequence-parallel groups ALST
trains with, as DeepSpeed 0.19.8 lays them out: consecutive ranks form a sequence group (a
``ParallelMesh(data=world // sp, sequence=sp)``'s sequence axis), and the sequence-data-parallel
group is every rank (ZeRO's replicas: parameters are replicated over both axes)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ......strategies.parallel.mesh import ParallelMesh

_MESH: ParallelMesh | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Collective: make the groups (once per job; DeepSpeed asserts against a second call)."""
    global _MESH
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: no process group joined; call deepspeed.init_distributed() "
                           "first")
    world = dist.get_world_size()
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size}")
    if _MESH is not None:
        raise RuntimeError("initialize_sequence_parallel: the sequence parallel group is already initialized")
    mesh = ParallelMesh(data=world // sequence_parallel_size, sequence=sequence_parallel_size)
    mesh.group("sequence")  # builds the mesh's groups on every rank
    _MESH = mesh


def _mesh() -> ParallelMesh:
    if _MESH is None:
        raise RuntimeError("sequence parallel group is not initialized: call initialize_sequence_parallel(n)")
    return _MESH


def get_sequence_parallel_group() -> Any:
    return _mesh().group("sequence")


def get_sequence_data_parallel_group() -> Any:
    _mesh()
    return dist.group.WORLD


def get_sequence_parallel_world_size() -> int:
    return _mesh().sequence


def get_sequence_data_parallel_world_size() -> int:
    return _mesh().world_size


def get_sequence_parallel_rank() -> int:
    return _mesh().coordinates(dist.get_rank())["sequence"]


def get_sequence_data_parallel_rank() -> int:
    _mesh()
    return dist.get_rank()


#: Megatron's names for the same (DeepSpeed's engine asks an ``mpu`` for them)
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
