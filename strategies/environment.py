"""Where this process sits in the job, and the process group that joins it to the others.

A process learns its rank from, in this order: a process group the user already initialised,
torchrun / torch.distributed.elastic (``TORCHELASTIC_RUN_ID``), SLURM (``srun``), our own launcher
(the ``ZEROTRAIN_LAUNCHED`` marker beside the standard variables), or nothing, which makes it rank 0
of a job it may still have to launch.

``Ranks`` (the base of ``Strategy``) reads this process's place as properties and offers the
collectives every strategy gives the Trainer (``reduce``, ``any_rank``, ``barrier``, ``broadcast``).
Its ``mesh`` (``parallel.ParallelMesh``; None: every rank a data-parallel replica) answers where the
rank sits along the data, sequence and tensor axes: ``data_parallel_*`` (what the loaders shard
by), ``replica_*`` (the ranks holding the same parameters: what ZeRO partitions and DDP reduces
over) and ``mesh_group(axis)``.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import os
import re
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import instrument, progress
from .parallel.mesh import AXES, ParallelMesh, mesh_shape, mesh_sizes
from .parallel.sequence import sequence_mean, shard_sequence


@dataclass(frozen=True)
class ProcessInfo:
    global_rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    #: "single", "local" (launched by us), "torchrun", "slurm" or "user" (process group exists)
    source: str = "single"

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def must_launch(self) -> bool:
        """True for rank 0 of a local job whose other ranks do not exist yet."""
        return self.source == "single" and self.world_size > 1


def _slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[003-005,007],gpu1``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return "127.0.0.1"
    base, _, ranges = m.groups()
    if not ranges:
        return base
    first = ranges.split(",")[0].split("-")[0]
    return base + first


def _in_slurm_batch() -> bool:
    # An interactive `salloc` shell (job name bash/interactive) is not a multi-process job step.
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_JOB_NAME") not in (
        "bash", "interactive")


def in_launched_job() -> bool:
    """This process is already a rank of a job: a process group the user made, torchrun (or our
    launcher's ranks), or a SLURM job step of several tasks. Where it is not, :func:`detect` makes
    it a one-node job (and a multi-node one is refused)."""
    env = os.environ
    return (dist.is_available() and dist.is_initialized()) or "TORCHELASTIC_RUN_ID" in env \
        or env.get("ZEROTRAIN_LAUNCHED") == "1" or _in_slurm_batch()


def detect(devices: int, num_nodes: int = 1) -> ProcessInfo:
    """Work out this process's place; ``devices`` x ``num_nodes`` is the requested world size."""
    env = os.environ
    if dist.is_available() and dist.is_initialized():
        ws, rank = dist.get_world_size(), dist.get_rank()
        lr = int(env.get("LOCAL_RANK", rank % max(devices, 1)))
        return ProcessInfo(rank, lr, ws, int(env.get("LOCAL_WORLD_SIZE", devices)), rank // max(devices, 1),
                           source="user")
    if "TORCHELASTIC_RUN_ID" in env or env.get("ZEROTRAIN_LAUNCHED") == "1":
        ws = int(env["WORLD_SIZE"])
        return ProcessInfo(
            global_rank=int(env["RANK"]), local_rank=int(env["LOCAL_RANK"]), world_size=ws,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", ws)), node_rank=int(env.get("GROUP_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 0)),
            source="local" if env.get("ZEROTRAIN_LAUNCHED") == "1" else "torchrun")
    if _in_slurm_batch():
        ws = int(env["SLURM_NTASKS"])
        port = int(env.get("MASTER_PORT", 15000 + int(env.get("SLURM_JOB_ID", "0")[-4:] or 0)))
        return ProcessInfo(
            global_rank=int(env["SLURM_PROCID"]), local_rank=int(env.get("SLURM_LOCALID", 0)), world_size=ws,
            local_world_size=int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=env.get("MASTER_ADDR", _slurm_first_host(env.get("SLURM_NODELIST", "127.0.0.1"))),
            master_port=port, source="slurm")
    if num_nodes > 1:
        raise RuntimeError(
            f"num_nodes={num_nodes} needs a multi-node launcher: start every node with torchrun "
            "(--nnodes, --rdzv-backend c10d) or srun; see the README's multi-node section.")
    return ProcessInfo(world_size=devices, local_world_size=devices, master_port=free_port(), source="single")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(info: ProcessInfo, device: torch.device, timeout_s: float) -> None:
    """Join the job's default process group (no-op for one process or a user's own group)."""
    if info.world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    init_default_group(backend=default_backend(device), rank=info.global_rank, world_size=info.world_size,
                       timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def init_default_group(**kwargs) -> None:
    """``dist.init_process_group(**kwargs)``, made safe to leave at interpreter exit.

    Two measured facts drive this. Importing ``torch._dynamo`` after the group exists (the first
    ``torch.optim`` optimizer does it lazily) leaves ten extra references to the default group, so
    ``destroy_process_group()`` no longer joins gloo's worker threads. A worker that releases the
    last reference to a finished collective while the interpreter finalizes then takes the GIL,
    and the process dies with "terminate called without an active exception" (SIGABRT) after a
    successful run. So dynamo is imported first, and the group we made is destroyed at exit while
    the interpreter is still whole.
    """
    import torch._dynamo  # noqa: F401  (before the group: see above)

    dist.init_process_group(**kwargs)
    atexit.register(_destroy_at_exit)


#: objects holding a reference to the default group (DDP's reducer does) that must let go of it
#: before the group is destroyed at exit: each has ``release_at_exit()``
_holders: "weakref.WeakSet[Any]" = weakref.WeakSet()


def release_at_exit(holder: Any) -> None:
    """Register ``holder`` (with a ``release_at_exit()`` method) to drop its references to the
    process group at interpreter exit, before the group is destroyed. ``destroy_process_group()``
    joins gloo's worker threads only when it drops the group's last reference; a DistributedDataParallel
    still alive (a Trainer kept in a global) holds one through its reducer, and the threads then run
    into finalization, where the process aborts (SIGABRT) after a successful run. The holders are
    released at exit even when the script (or the user's own code) destroyed the group first: that
    destruction joined nothing, and letting go of the last reference joins the threads then."""
    global _release_registered
    if not _release_registered:
        atexit.register(_release_holders)  # runs after _destroy_at_exit when both are registered
        _release_registered = True
    _holders.add(holder)


_release_registered = False


#: how long the main thread lets go of the GIL before it destroys a gloo group at exit
SETTLE_S = 0.2


def _let_workers_settle() -> None:
    """Give gloo's worker threads the GIL for a moment. A worker drops its last reference to a
    finished collective only after ``wait()`` has returned to Python, and when that collective's
    tensors were ever seen by Python, dropping them takes the GIL. Destroying the group joins the
    workers while the main thread holds the GIL (pybind11 deallocation): a worker still on its way
    to that decref then waits for the GIL forever, and the process hangs at exit (seen in CI after
    a SIGTERM checkpoint: the main thread in ``~ProcessGroupGloo`` joining, a worker in
    ``~AsyncAllreduceWork`` acquiring the GIL). Sleeping releases the GIL, so the worker finishes."""
    time.sleep(SETTLE_S)


def _release_holders() -> None:
    holders = list(_holders)
    if holders:
        _let_workers_settle()
    for holder in holders:
        holder.release_at_exit()
    if holders:
        gc.collect()  # what the holders let go of sits in reference cycles (hooks bound to them)
    _holders.clear()


def _destroy_at_exit() -> None:
    _release_holders()  # idempotent; needed here when a holder registered before the group was made
    if dist.is_initialized():
        _let_workers_settle()
        dist.destroy_process_group()


#: what a process that runs several multi-process jobs one after another (``zerotrain-train
#: --multirun``) calls between them: the group is destroyed as at exit, so the next job makes its own
destroy_default_group = _destroy_at_exit


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator='cuda' was requested but torch sees no CUDA device; "
                               "use accelerator='cpu' or 'auto'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if accelerator != "cpu":
        raise ValueError(f"accelerator={accelerator!r} is not supported; valid choices: cpu, cuda, auto")
    return torch.device("cpu")


#: torch's thread count when zerotrain was imported: a different count at fit time is the user's
_THREADS_AT_IMPORT = torch.get_num_threads()


def set_cpu_threads(info: ProcessInfo) -> None:
    """Split the cores between the local ranks: oversubscribed ranks were 2x slower here. A
    count the user set (``torch.set_num_threads`` after importing zerotrain) is left alone."""
    if torch.get_num_threads() != _THREADS_AT_IMPORT:
        return
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, info.local_world_size)))


class Ranks:
    """This process's place (``info``, set by ``connect``) and its collectives over the job's
    ranks; a strategy that splits ranks another way (pipeline stages) overrides the
    ``data_parallel_*`` properties."""

    info: ProcessInfo
    device: torch.device
    #: the job's shape (``parallel.ParallelMesh``), set at ``setup_environment`` where a strategy
    #: has a sequence or tensor axis; None: every rank is a data-parallel replica of the others
    mesh: "ParallelMesh | None" = None
    #: the sizes of the mesh's axes other than data (``mesh_sizes``: the strategy's
    #: ``sequence_parallel=``); the data axis is what remains of the world
    parallel_sizes: dict[str, int] = {}
    #: the axes besides data this strategy runs over (a size > 1 elsewhere is refused before any
    #: rank starts). A sequence axis needs nothing of the gradient reductions (its ranks are
    #: replicas); a tensor axis needs them over ``replica_group``.
    mesh_axes: tuple[str, ...] = ("sequence",)

    def check_mesh(self, world_size: int) -> None:
        """ValueError (the option, its value, what is valid) before any rank starts."""
        mesh_shape(self.parallel_sizes, world_size, type(self).__name__, self.mesh_axes)

    def build_mesh(self) -> None:
        """``self.mesh`` from ``parallel_sizes`` over this job's world (None where every axis but
        data has size 1). Collective: the mesh's process groups are made here, on every rank alike."""
        sizes = mesh_shape(self.parallel_sizes, self.world_size, type(self).__name__, self.mesh_axes)
        self.mesh = ParallelMesh(**sizes) if any(n > 1 for a, n in sizes.items() if a != "data") else None
        if self.mesh is not None and self.distributed:
            self.mesh.device_mesh(self.device.type)
            for axis in (a for a in AXES if getattr(self.mesh, a) > 1):  # the comms logger's names
                instrument.name_group(self.mesh.group(axis, self.device.type), axis)
            instrument.name_group(self.mesh.replica_group(), "replicas")

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a batch its sequence group shares: the module's
        ``shard_batch(batch, rank, size)`` where it has one, else ``parallel.shard_sequence``
        (tensors cut along dimension 1). The batch itself without a sequence axis."""
        size = self.mesh_size("sequence")
        if size == 1:
            return batch
        module = getattr(self, "module", None)
        cut = getattr(module, "shard_batch", None) or shard_sequence
        return cut(batch, self.mesh_rank("sequence"), size)

    def sequence_positions(self, length: int) -> torch.Tensor:
        """The positions in the whole sequence of this rank's ``length`` tokens (its shard)."""
        start = self.mesh_rank("sequence") * length
        return torch.arange(start, start + length, device=self.device)

    def sequence_loss(self, loss_sum: torch.Tensor, count: "torch.Tensor | int") -> torch.Tensor:
        """This rank's loss where its sequence group shares one batch: ``loss_sum`` (its tokens'
        summed loss) x group size / the tokens the whole group counts, so that the mean over the
        replicas - what DDP and ZeRO average gradients by - is the mean over every token of the
        global batch (``parallel.sequence_mean``). Without a sequence axis: ``loss_sum / count``."""
        return sequence_mean(loss_sum, count, self.mesh_group("sequence"), self.mesh_size("sequence"))
    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def global_rank(self) -> int:
        return self.info.global_rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_global_zero(self) -> bool:
        return self.info.global_rank == 0

    @property
    def data_parallel_world_size(self) -> int:
        """How many replicas see different data (the Trainer's DistributedSampler uses this).
        Equal to world_size unless a strategy splits ranks another way (pipeline stages, the
        mesh's sequence and tensor axes: their ranks see the same batch)."""
        return self.world_size if self.mesh is None else self.mesh.data

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank if self.mesh is None else self._coordinate("data")

    def _coordinate(self, axis: str) -> int:
        return 0 if self.mesh is None else self.mesh.coordinates(self.global_rank)[axis]

    def mesh_size(self, axis: str) -> int:
        """The mesh's size along ``axis`` ("data", "sequence", "tensor"); without a mesh: the
        world along "data", 1 along the others."""
        if self.mesh is None:
            return self.world_size if axis == "data" else 1
        return getattr(self.mesh, axis)

    def mesh_rank(self, axis: str) -> int:
        """This rank's index along ``axis`` (its rank in ``mesh_group(axis)``)."""
        return self.global_rank if self.mesh is None and axis == "data" else self._coordinate(axis)

    def mesh_group(self, axis: str) -> "dist.ProcessGroup | None":
        """This rank's process group along ``axis``; None without a mesh (along "data": the
        default group, the whole world)."""
        return None if self.mesh is None else self.mesh.group(axis, self.device.type)

    @property
    def replica_world_size(self) -> int:
        """How many ranks hold the same parameters as this one (data x sequence): ZeRO's
        partitions and DDP's gradient average run over them."""
        return self.world_size if self.mesh is None else self.mesh.replica_size

    @property
    def replica_rank(self) -> int:
        """This rank's index among its replicas (its ZeRO partition)."""
        if self.mesh is None:
            return self.global_rank
        return self.mesh.replicas(self.global_rank).index(self.global_rank)

    @property
    def replica_group(self) -> "dist.ProcessGroup | None":
        """The process group of this rank's replicas; None: the default group (every rank)."""
        return None if self.mesh is None or not self.distributed else self.mesh.replica_group()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------ collectives
    def reduce(self, value: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        """Sum or mean over ranks (SUM then divide: ReduceOp.AVG is unreliable on gloo)."""
        if op not in ("mean", "sum", "max"):
            raise ValueError(f"reduce op={op!r}; valid choices: mean, sum, max")
        t = torch.as_tensor(value, dtype=torch.float64 if not torch.is_tensor(value) else None)
        t = t.detach().clone().to(self.device)
        if self.distributed:
            progress.mark("all_reduce (Strategy.reduce)")
            with instrument.blocking("all_reduce", t, control=True):
                dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "mean":
                t = t / self.world_size
        return t

    def any_rank(self, flag: bool) -> bool:
        if not self.distributed:
            return bool(flag)
        return bool(self.reduce(torch.tensor(float(flag)), op="max").item() > 0)

    def barrier(self) -> None:
        if self.distributed:
            progress.mark("barrier")
            with instrument.blocking("barrier", None, control=True):
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        progress.mark("broadcast")
        with instrument.blocking("broadcast_object", None, control=True):
            dist.broadcast_object_list(box, src=src)
        return box[0]
