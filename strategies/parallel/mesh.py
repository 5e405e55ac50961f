"""The parallel shape of a job: how its ranks factor into a data, a sequence and a tensor axis.

``ParallelMesh(data=2, sequence=2)`` on 4 ranks puts the sequence axis inside the data axis
(consecutive ranks share a sequence group, as DeepSpeed lays out its sequence-parallel groups, and as
``init_device_mesh`` orders a row-major mesh): rank = data_index * sequence + sequence_index. The
tensor axis is innermost (Megatron's order: a tensor group's ranks are neighbours):
rank = (data_index * sequence + sequence_index) * tensor + tensor_index.

The *replicas* of a rank are the ranks that hold the same parameters: those differing from it along
the data and sequence axes only (every rank with its tensor index). ZeRO partitions, and DDP
all-reduces, over them (``Ranks.replica_group``); the data axis alone is what the loaders shard by.

The arithmetic (coordinates, the members of each sub-group) is plain Python and needs no process
group; ``device_mesh()`` builds torch's ``DeviceMesh`` over the joined default group with
``init_device_mesh`` (gloo on CPU, NCCL on CUDA) and ``group(axis)`` gives this rank's
sub-group of that axis from it.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

#: the mesh's axes, outermost first
AXES = ("data", "sequence", "tensor")
#: the axes along which parameters are replicated (a tensor axis shards them)
REPLICA_AXES = ("data", "sequence")


@dataclasses.dataclass(frozen=True)
class ParallelMesh:
    data: int = 1
    sequence: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelMesh: {axis}={size!r}; valid: a positive int")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def world_size(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ParallelMesh{self.shape}: rank={rank}; valid: 0..{self.world_size - 1}")

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each axis (row-major, the last axis innermost)."""
        self._check_rank(rank)
        out, rest = {}, rank
        for axis, size in reversed(list(zip(AXES, self.shape))):
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in AXES}

    def rank_of(self, **coordinates: int) -> int:
        """The rank at the given indices (axes not named are at 0)."""
        unknown = set(coordinates) - set(AXES)
        if unknown:
            raise ValueError(f"ParallelMesh.rank_of: axes {sorted(unknown)}; valid: {list(AXES)}")
        rank = 0
        for axis, size in zip(AXES, self.shape):
            index = coordinates.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"ParallelMesh.rank_of: {axis}={index}; valid: 0..{size - 1}")
            rank = rank * size + index
        return rank

    def members(self, axis: str, rank: int) -> list[int]:
        """The ranks in ``rank``'s sub-group along ``axis``: those differing from it only there,
        in the order of their index along it."""
        if axis not in AXES:
            raise ValueError(f"ParallelMesh: axis={axis!r}; valid: {list(AXES)}")
        where = self.coordinates(rank)
        return [self.rank_of(**{**where, axis: i}) for i in range(getattr(self, axis))]

    def replicas(self, rank: int) -> list[int]:
        """The ranks holding the same parameters as ``rank`` (``REPLICA_AXES``), in rank order."""
        self._check_rank(rank)
        mine = self.coordinates(rank)["tensor"]
        return [r for r in range(self.world_size) if self.coordinates(r)["tensor"] == mine]

    @property
    def replica_size(self) -> int:
        return self.data * self.sequence

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every sub-group along ``axis`` (each rank in exactly one), by their first rank."""
        seen: dict[int, list[int]] = {}
        for rank in range(self.world_size):
            members = self.members(axis, rank)
            seen.setdefault(members[0], members)
        return [seen[k] for k in sorted(seen)]

    # ------------------------------------------------------------------ on a joined process group
    def device_mesh(self, device_type: str = "cpu"):
        """torch's ``DeviceMesh`` of this shape over the default group (which must be joined and
        have exactly ``world_size`` ranks), its dimensions named after ``AXES``."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.device_mesh: no process group joined; join one first "
                               "(torch.distributed.init_process_group)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelMesh{self.shape}: needs {self.world_size} ranks; the job has "
                             f"{dist.get_world_size()}")
        return _MESHES.get(self, device_type)

    def group(self, axis: str, device_type: str = "cpu") -> dist.ProcessGroup:
        """This rank's process group along ``axis``."""
        if axis not in AXES:
            raise ValueError(f"ParallelMesh: axis={axis!r}; valid: {list(AXES)}")
        return self.device_mesh(device_type).get_group(axis)

    def replica_group(self) -> "dist.ProcessGroup | None":
        """This rank's process group of replicas (``replicas``); None where that is every rank (the
        default group: what ZeRO and DDP used before there was a mesh). Collective: every rank
        calls it (each group is made on every rank, in the same order)."""
        if self.tensor == 1:
            return None
        return _MESHES.replica_group(self)


def mesh_sizes(owner: str, **sizes: int) -> dict[str, int]:
    """A strategy's ``<axis>_parallel=`` options, checked (a whole number >= 1 each)."""
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{owner}: {axis}_parallel={size!r}; valid: a whole number >= 1")
    return dict(sizes)


def mesh_shape(sizes: dict[str, int], world_size: int, owner: str = "strategy",
               supported: tuple[str, ...] = AXES[1:]) -> dict[str, int]:
    """Every axis's size for ``world_size`` ranks, given the sizes of the axes other than data
    (the data axis is what remains); ValueError naming the option where they do not divide it or
    ``owner`` does not run over that axis."""
    inner = 1
    for axis, size in sizes.items():
        if size > 1 and axis not in supported:
            raise ValueError(f"{owner}: {axis}_parallel={size}; this strategy runs over "
                             f"{', '.join(supported) or 'no axis but data'}; valid: {axis}_parallel=1")
        inner *= size
    if world_size % inner:
        named = " x ".join(f"{axis}_parallel={n}" for axis, n in sizes.items() if n > 1)
        raise ValueError(f"{owner}: {named} does not divide the {world_size} processes (devices x num_nodes); "
                         f"valid: a process count that is a multiple of {inner}")
    return {"data": world_size // inner, **sizes}


class _MeshCache:
    """One ``DeviceMesh`` per (shape, device type) and process group: building one issues
    collectives (every rank must build it alike), so repeated ``group()`` calls reuse it."""

    def __init__(self) -> None:
        self._meshes: dict = {}

    def get(self, mesh: ParallelMesh, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        key = (mesh, device_type, id(dist.group.WORLD))
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(device_type, mesh.shape, mesh_dim_names=AXES)
        return self._meshes[key]

    def replica_group(self, mesh: ParallelMesh):
        key = ("replicas", mesh, id(dist.group.WORLD))
        if key not in self._meshes:
            mine, rank = None, dist.get_rank()
            for t in range(mesh.tensor):  # every rank makes every group, in the same order
                members = mesh.replicas(mesh.rank_of(tensor=t))
                group = dist.new_group(members)
                mine = group if rank in members else mine
            self._meshes[key] = mine
        return self._meshes[key]


_MESHES = _MeshCache()
