"""``deepspeed.comm``: DeepSpeed's communication calls, which are torch.distributed's under its
names. ``init_distributed`` (which ``deepspeed.initialize`` calls) makes a group even for a single
process; before it has run, the queries answer for one process (rank 0 of 1) and the collectives
leave their tensors as they are, as they would be in a group of one (DeepSpeed raises there).
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp  # noqa: F401  (deepspeed.comm.ReduceOp)

from .....strategies.environment import init_default_group
from ..accelerator import get_accelerator

log = logging.getLogger("zerotrain")
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30), init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group from the launcher's variables (torchrun, the ``deepspeed``
    launcher, SLURM through them: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or from
    ``init_method``/``rank``/``world_size``; a single process started without those variables
    makes a group of one (``_init_group_of_one``). Nothing to do when a group exists or when
    ``dist_init_required`` is False. ``auto_mpi_discovery``, ``verbose`` and ``config`` are
    accepted for DeepSpeed's signature."""
    if dist.is_initialized() or dist_init_required is False:
        return
    env = os.environ
    backend = dist_backend or get_accelerator().communication_backend_name()
    if init_method is None and rank < 0 and not all(k in env for k in _ENV):
        if "RANK" in env or "WORLD_SIZE" in env:
            missing = [k for k in _ENV if k not in env]
            raise RuntimeError(f"init_distributed: {', '.join(missing)} not set; valid: start the script with "
                               "torchrun or the deepspeed launcher (which set RANK, WORLD_SIZE, MASTER_ADDR, "
                               "MASTER_PORT), or pass init_method, rank and world_size")
        _init_group_of_one(backend, timeout)
        return
    env.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method or "env://", "timeout": timeout}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    init_default_group(**kwargs)
    if verbose and dist.get_rank() == 0:
        log.info("zerotrain.deepspeed: process group of %d (%s)", dist.get_world_size(), kwargs["backend"])


def _init_group_of_one(backend: str, timeout: datetime.timedelta) -> None:
    """A process started without a launcher: a process group of one, which is what DeepSpeed
    ends up with there (its MPI discovery finds a world of one), so that the script's own
    ``torch.distributed`` calls (``get_rank()``, ``barrier()``) work. The rendezvous store lives in
    this process (no port to collide on, no file to clean up); ``init_default_group`` destroys the
    group at exit like every group zerotrain makes."""
    init_default_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group: Any = None) -> str | None:
    return dist.get_backend(group) if dist.is_initialized() else None


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    if dist.is_initialized():
        return dist.barrier(group=group, async_op=async_op)
    return None


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def broadcast_object_list(object_list: list, src: int = 0, group: Any = None, device: Any = None) -> None:
    if dist.is_initialized():
        dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def all_gather_object(object_list: list, obj: Any, group: Any = None) -> None:
    if dist.is_initialized():
        dist.all_gather_object(object_list, obj, group=group)
    else:
        object_list[0] = obj


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if dist.is_initialized():
        return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    output.copy_(tensor)
    return None


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src, group=group, tag=tag)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


#: the engine whose collectives are recorded (config ``comms_logger.enabled``) and its record
_recording: "tuple[Any, Any] | None" = None


def record(engine: Any) -> Any:
    """Start recording every collective ``engine``'s strategy issues (``comms_logger.enabled``);
    returns the record, whose ``step`` the engine moves on after each optimizer step."""
    global _recording
    from .....callbacks.measure.comms import StepRecorder
    from .....strategies import instrument

    recorder = StepRecorder(engine._cfg.comms_verbose)
    instrument.add_sink(recorder)
    _recording = (recorder, engine)
    return recorder


def stop_recording(recorder: Any) -> None:
    global _recording
    from .....strategies import instrument

    instrument.remove_sink(recorder)
    if _recording is not None and _recording[0] is recorder:
        _recording = None


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """DeepSpeed's ``comms_logger`` summary: every collective so far by op and message size
    (count, latency, algorithm and bus bandwidth) and the bytes of each step beside the ZeRO
    formula, printed on global rank 0. Needs ``"comms_logger": {"enabled": true}`` in the
    config; ``show_straggler`` is not measured (said once)."""
    if show_straggler:
        log.warning("zerotrain.deepspeed.comm.log_summary(show_straggler=True): straggler times are not measured")
    if _recording is None:
        log.warning("zerotrain.deepspeed.comm.log_summary(): nothing recorded; enable it with "
                    '"comms_logger": {"enabled": true} in the DeepSpeed config')
        return {} if return_dict else None
    recorder, engine = _recording
    summary, text = recorder.report(engine._zt.strategy, engine.gradient_accumulation_steps(), engine.clip_bytes())
    if engine.global_rank == 0:
        print(text)
    return {"summary": summary} if return_dict else None
