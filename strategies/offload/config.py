"""The offload policy: where fp32 master weights, optimizer state and (ZeRO-3) parameter shards
live, and how they are moved. Validated once, when the strategy is built; every error names the
field, its value and the valid choices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..options import check_bool, check_choice, whole_number
from ..paths import directory_problem
from .aio import ALIGN

OPTIMIZER_DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")
GRAD_DEVICES = ("cpu", "nvme")
#: dtypes the swap files may hold Adam's moments in (the fp32 master is always fp32)
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: dtypes ZeRO-3's parameter files may hold the working shards in ("auto": the precision's
#: working dtype; the fp32 master is always fp32)
PARAM_DTYPES = {"auto": None, "bf16": torch.bfloat16}

@dataclass(frozen=True)
class OffloadPolicy:
    """Where fp32 master weights, optimizer state and (ZeRO-3) parameter shards live, and how
    they move. Composed with a ZeRO stage (2 or 3) by ``Offload(stage=..., ...)``."""

    #: where fp32 master weights and Adam state live: "cpu" (host RAM) or "nvme" (files)
    optimizer_device: str = "cpu"
    #: where ZeRO-3 parameter shards live between uses: "none" (with the working params), "cpu"
    #: or "nvme"; anything but "none" needs stage=3
    param_device: str = "none"
    #: directory for swap files (required when a device is "nvme"); each rank makes its own
    #: sub-directory and removes it at the end
    nvme_path: Optional[str] = None
    #: page-lock host staging buffers (only meaningful with a CUDA device)
    pin_memory: bool = True
    #: staging buffers for swapped sub-groups (2 = double buffering; 4 also overlaps write-backs)
    buffer_count: int = 4
    #: ``grad_device="nvme"``: staging buffers (one sub-group's gradient each) for backward's
    #: gradient writes, i.e. how many may be in flight before backward waits for the disk. None:
    #: ``buffer_count``. A unit has about (its partition / ``sub_group_size``) sub-groups; with
    #: that many or more its whole gradient is written behind the next unit's backward, for that
    #: much RAM (reduce-dtype bytes of the unit's partition)
    grad_buffer_count: Optional[int] = None
    #: elements of this rank's partition stepped (and swapped) together
    sub_group_size: int = 10_000_000
    #: threads doing swap-file I/O
    io_threads: int = 2
    #: bytes per I/O request handed to one thread (a multiple of 4096)
    io_block_size: int = 8 << 20
    #: use O_DIRECT where the file system supports it (detected at set-up; else buffered I/O)
    direct_io: bool = True
    #: dtype of Adam's exp_avg/exp_avg_sq in the swap files: "fp32" or "bf16" (half the bytes;
    #: the kernel rounds them stochastically, the fp32 master stays fp32; checkpoints hold fp32
    #: either way); "bf16" needs optimizer_device="nvme"
    optimizer_state_dtype: str = "fp32"
    #: where ZeRO-3's reduced gradient partition waits for the step: "cpu" (RAM, reduce-dtype bytes
    #: per parameter) or "nvme" (each unit's reduced gradient is written into the sub-group swap
    #: files as its reduction lands, and the step reads it back with the sub-group's state: no
    #: whole-model gradient in RAM, for the reduce-dtype bytes written and read once more per
    #: step, and a read-back per extra micro-batch). "nvme" needs stage=3, optimizer_device="nvme"
    #: and no fp16 loss scaling
    grad_device: str = "cpu"
    #: dtype of ZeRO-3's working parameter shards in their files: "auto" (the precision's working
    #: dtype: in fp32 compute the fp32 file is the master itself) or "bf16" (in fp32 compute: a bf16
    #: shard file, which the forward and backward gathers read and upcast to fp32, beside an fp32
    #: master file the optimizer steps: 2 B/param read per gather instead of 4, for 2 B/param
    #: more on disk; the forward sees bf16-rounded weights; the small parameters ZeRO-3 keeps
    #: gathered in RAM, param_persistence_threshold, stay fp32). "bf16" needs param_device="nvme";
    #: under bf16-mixed it is what "auto" does
    param_dtype: str = "auto"

    def __post_init__(self) -> None:
        for f in ("buffer_count", "sub_group_size", "io_threads", "io_block_size"):
            object.__setattr__(self, f, whole_number("Offload", f, getattr(self, f), 1))
        if self.grad_buffer_count is not None:
            object.__setattr__(self, "grad_buffer_count",
                               whole_number("Offload", "grad_buffer_count", self.grad_buffer_count, 1))
            if self.grad_device != "nvme":
                raise ValueError(f"Offload: grad_buffer_count={self.grad_buffer_count!r} sets the gradient "
                                 f"writes' staging with grad_device='nvme', and grad_device="
                                 f"{self.grad_device!r} keeps the gradients in RAM; valid: grad_device='nvme', "
                                 f"or grad_buffer_count=None")
        for f in ("pin_memory", "direct_io"):
            check_bool("Offload", f, getattr(self, f))
        check_choice("Offload", "optimizer_device", self.optimizer_device, OPTIMIZER_DEVICES)
        check_choice("Offload", "param_device", self.param_device, PARAM_DEVICES)
        check_choice("Offload", "optimizer_state_dtype", self.optimizer_state_dtype, STATE_DTYPES)
        check_choice("Offload", "grad_device", self.grad_device, GRAD_DEVICES)
        check_choice("Offload", "param_dtype", self.param_dtype, PARAM_DTYPES)
        if self.param_dtype != "auto" and self.param_device != "nvme":
            raise ValueError(f"Offload: param_dtype={self.param_dtype!r} is the dtype of ZeRO-3's parameter "
                             f"files, and param_device={self.param_device!r} keeps no parameter files; "
                             f"valid: param_device='nvme', or param_dtype='auto'")
        if self.grad_device == "nvme" and self.optimizer_device != "nvme":
            raise ValueError(f"Offload: grad_device='nvme' writes the gradients into the optimizer's swap "
                             f"files, and optimizer_device={self.optimizer_device!r} has none; valid: "
                             f"optimizer_device='nvme', or grad_device='cpu'")
        if self.optimizer_state_dtype != "fp32" and self.optimizer_device != "nvme":
            raise ValueError(f"Offload: optimizer_state_dtype={self.optimizer_state_dtype!r} is the dtype of the "
                             f"Adam moments in the swap files, and optimizer_device="
                             f"{self.optimizer_device!r} keeps them in RAM; valid: optimizer_device='nvme', "
                             f"or optimizer_state_dtype='fp32'")
        if self.uses_nvme:
            if not isinstance(self.nvme_path, str) or not self.nvme_path:
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r} must name a directory when "
                                 f"optimizer_device={self.optimizer_device!r} and "
                                 f"param_device={self.param_device!r} (a device is 'nvme')")
            problem = directory_problem(self.nvme_path)
            if problem:
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r}: {problem}; valid: a writable "
                                 f"directory on a local disk (created if missing), e.g. /local_nvme/zerotrain")
        if self.io_block_size < ALIGN or self.io_block_size % ALIGN:
            raise ValueError(f"Offload: io_block_size={self.io_block_size!r} must be a positive "
                             f"multiple of {ALIGN} bytes")

    @property
    def grad_buffers(self) -> int:
        """Staging buffers for backward's gradient writes (``grad_device="nvme"``)."""
        return self.grad_buffer_count if self.grad_buffer_count is not None else self.buffer_count

    @property
    def uses_nvme(self) -> bool:
        return self.optimizer_device == "nvme" or self.param_device == "nvme"
