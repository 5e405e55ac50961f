"""The Offload strategy's per-rank RAM and disk bytes (``estimate_offload``) and the largest model
that fits a machine (``largest_offload_model``), as the strategy lays things out. Every option's
vocabulary and default is ``OffloadPolicy``'s (``config.py``), written once there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..memory.formula import PRECISION_BYTES, ModelStates
from .config import GRAD_DEVICES, OPTIMIZER_DEVICES, PARAM_DEVICES, PARAM_DTYPES, STATE_DTYPES, OffloadPolicy
from .stepper import STAGES as OFFLOAD_STAGES

#: ``OffloadPolicy``'s defaults by field name
POLICY_DEFAULTS = {f.name: f.default for f in fields(OffloadPolicy)}
#: bytes per element of Adam's moments in each ``optimizer_state_dtype``
STATE_DTYPE_BYTES = {name: dtype.itemsize for name, dtype in STATE_DTYPES.items()}


@dataclass(frozen=True)
class OffloadBytes:
    """Bytes one rank holds in RAM and on disk with the Offload strategy (``ram.optimizer``
    includes the swap staging buffers; ``disk.params`` is the ZeRO-3 parameter files, which hold
    the working shard and, in mixed precision, the fp32 master shard)."""

    ram: ModelStates
    disk: ModelStates


def estimate_offload(num_params: int, world_size: int = 1, stage: int = 3, precision: str = "32", *,
                     optimizer_device: str = "nvme", param_device: str = "nvme",
                     optimizer_state_dtype: str = POLICY_DEFAULTS["optimizer_state_dtype"],
                     grad_bytes: int | None = None, sub_group_size: int = POLICY_DEFAULTS["sub_group_size"],
                     buffer_count: int = POLICY_DEFAULTS["buffer_count"],
                     grad_device: str = POLICY_DEFAULTS["grad_device"], param_dtype: str = POLICY_DEFAULTS["param_dtype"],
                     grad_buffer_count: int | None = POLICY_DEFAULTS["grad_buffer_count"]) -> OffloadBytes:
    """Per-rank bytes of ``Offload(stage, optimizer_device, param_device, optimizer_state_dtype)``
    as it lays things out (page padding of the swap files aside). With ``Psi`` parameters, shard
    ``S = ceil(Psi / world_size)``, working bytes ``p`` (4 fp32, 2 mixed), gradient bytes ``g``
    (the reduce dtype; the precision's by default) and moment bytes ``s`` (4 fp32, 2 bf16):

    * working parameters: ``p * Psi`` in RAM (stage 2); ``p * S`` (stage 3), on disk with
      ``param_device="nvme"``;
    * gradient partition: ``g * S``, in RAM, or in the swap files with ``grad_device="nvme"``
      (stage 3 with ``optimizer_device="nvme"``), ``grad_buffer_count`` (``buffer_count`` by
      default) sub-groups of it staged in RAM;
    * fp32 master: none of its own in fp32 compute (the working parameters are the master);
      mixed: ``4 * S`` beside the working shard (stage 3 parameter files), in the swap files
      (stage 2 with ``optimizer_device="nvme"``) or in RAM; ``param_dtype="bf16"`` in fp32
      compute: a bf16 working shard (``p = 2``) beside the fp32 master in the parameter files;
    * Adam's moments: ``2 * s * S``, in the swap files with ``optimizer_device="nvme"``, else in
      RAM (fp32: ``optimizer_state_dtype="bf16"`` needs NVMe);
    * with swap files, ``buffer_count`` staging buffers of one sub-group's swapped bytes in RAM.
    """
    if stage not in OFFLOAD_STAGES:
        raise ValueError(f"stage={stage!r}; valid choices: 2, 3")
    for name, value, valid in (("optimizer_device", optimizer_device, OPTIMIZER_DEVICES),
                               ("param_device", param_device, PARAM_DEVICES),
                               ("optimizer_state_dtype", optimizer_state_dtype, tuple(STATE_DTYPE_BYTES)),
                               ("grad_device", grad_device, GRAD_DEVICES),
                               ("param_dtype", param_dtype, PARAM_DTYPES)):
        if value not in valid:
            raise ValueError(f"{name}={value!r}; valid choices: {', '.join(valid)}")
    if param_device != "none" and stage != 3:
        raise ValueError(f"param_device={param_device!r} needs stage=3; valid with stage={stage}: 'none'")
    if optimizer_state_dtype != "fp32" and optimizer_device != "nvme":
        raise ValueError(f"optimizer_state_dtype={optimizer_state_dtype!r} needs optimizer_device='nvme'; "
                         f"valid with optimizer_device={optimizer_device!r}: 'fp32'")
    if grad_device == "nvme" and (stage != 3 or optimizer_device != "nvme"):
        raise ValueError(f"grad_device='nvme' needs stage=3 and optimizer_device='nvme'; valid with stage={stage}, "
                         f"optimizer_device={optimizer_device!r}: 'cpu'")
    if param_dtype != "auto" and param_device != "nvme":
        raise ValueError(f"param_dtype={param_dtype!r} needs param_device='nvme'; valid with "
                         f"param_device={param_device!r}: 'auto'")
    p, g, m, _ = PRECISION_BYTES[_precision(precision)]
    g = g if grad_bytes is None else grad_bytes
    if param_dtype == "bf16" and m == 0:  # fp32 compute: a bf16 working shard beside the fp32 master
        p, m = 2, 4
    shard = math.ceil(_whole(num_params, "num_params") / _whole(world_size, "world_size", 1))
    params = p * (num_params if stage == 2 else shard)
    master, moments = m * shard, 2 * STATE_DTYPE_BYTES[optimizer_state_dtype] * shard
    params_on_disk = param_device == "nvme"
    # stage 3 keeps the master beside its working shard (the unit's, in files or RAM); stage 2
    # swaps it with the moments when it is a separate copy
    master_on_disk = params_on_disk if stage == 3 else optimizer_device == "nvme"
    on_disk = optimizer_device == "nvme"
    swapped_per_elem = (m if master_on_disk and stage == 2 else 0) + 2 * STATE_DTYPE_BYTES[optimizer_state_dtype]
    staging = buffer_count * min(sub_group_size, shard) * swapped_per_elem if on_disk else 0
    grads_on_disk = grad_device == "nvme"
    grad_buffers = buffer_count if grad_buffer_count is None else grad_buffer_count
    grad_staging = grad_buffers * min(sub_group_size, shard) * g
    ram = ModelStates(0 if params_on_disk else params, grad_staging if grads_on_disk else g * shard,
                      0 if master_on_disk else master, staging if on_disk else moments)
    disk = ModelStates(params if params_on_disk else 0, g * shard if grads_on_disk else 0,
                       master if master_on_disk else 0, moments if on_disk else 0)
    return OffloadBytes(ram, disk)


def largest_offload_model(ram_bytes: float, disk_bytes: float, world_size: int = 1, **options) -> int:
    """The largest parameter count whose ``estimate_offload(...)`` fits, all ``world_size`` ranks
    together, in ``ram_bytes`` of RAM and ``disk_bytes`` of disk (both are one machine's, shared by
    its ranks). Found by bisection, so it holds for any option combination: it fits, one more
    parameter per rank does not."""
    def fits(n: int) -> bool:
        est = estimate_offload(n, world_size, **options)
        return est.ram.total * world_size <= ram_bytes and est.disk.total * world_size <= disk_bytes

    if not fits(0):
        return 0
    hi = 1
    while fits(hi):
        hi *= 2
        if hi > 1 << 60:
            raise ValueError("no bound: nothing that grows with the model is counted against RAM or disk")
    lo = hi // 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _precision(precision: str) -> str:
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; valid choices: {', '.join(PRECISION_BYTES)}")
    return precision


def _whole(value: int, name: str, low: int = 0) -> int:
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return value
