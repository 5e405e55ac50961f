"""The offload policy: where fp32 master weights, optimizer state and (ZeRO-3) parameter shards
live, and how they are moved. Validated once, when the strategy is built; every error names the
field, its value and the valid choices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..options import check_bool, check_choice, whole_number
from ..paths import directory_problem
from .aio import ALIGN

OPTIMIZER_DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")

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
    #: elements of this rank's partition stepped (and swapped) together
    sub_group_size: int = 10_000_000
    #: threads doing swap-file I/O
    io_threads: int = 2
    #: bytes per I/O request handed to one thread (a multiple of 4096)
    io_block_size: int = 8 << 20
    #: use O_DIRECT where the file system supports it (detected at set-up; else buffered I/O)
    direct_io: bool = True

    def __post_init__(self) -> None:
        for f in ("buffer_count", "sub_group_size", "io_threads", "io_block_size"):
            object.__setattr__(self, f, whole_number("Offload", f, getattr(self, f), 1))
        for f in ("pin_memory", "direct_io"):
            check_bool("Offload", f, getattr(self, f))
        check_choice("Offload", "optimizer_device", self.optimizer_device, OPTIMIZER_DEVICES)
        check_choice("Offload", "param_device", self.param_device, PARAM_DEVICES)
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
    def uses_nvme(self) -> bool:
        return self.optimizer_device == "nvme" or self.param_device == "nvme"
