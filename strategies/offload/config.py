"""The offload policy: where fp32 master weights, optimizer state and (ZeRO-3) parameter shards
live, and how they are moved. Validated once, when the strategy is built; every error names the
field, its value and the valid choices."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

from .aio import ALIGN

OPTIMIZER_DEVICES = ("cpu", "nvme")
PARAM_DEVICES = ("none", "cpu", "nvme")


def available_stages() -> tuple[int, ...]:
    """ZeRO stages offload can compose with in this build (3 once ``zero/stage3.py`` exists)."""
    try:
        from ..zero import stage3  # noqa: F401
    except ImportError:
        return (2,)
    return (2, 3)


@dataclass(frozen=True)
class OffloadConfig:
    #: the ZeRO stage the offload composes with
    stage: int = 2
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
        for f in ("stage", "buffer_count", "sub_group_size", "io_threads", "io_block_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"Offload: {f}={v!r} must be an integer")
        for f in ("pin_memory", "direct_io"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"Offload: {f}={getattr(self, f)!r} must be True or False")
        stages = available_stages()
        if self.stage not in stages:
            why = "" if 3 in stages or self.stage != 3 else \
                " (ZeRO-3 is not in this build: strategies/zero/stage3.py is missing)"
            raise ValueError(f"Offload: stage={self.stage!r}{why}; valid choices: "
                             f"{', '.join(map(str, stages))}")
        if self.optimizer_device not in OPTIMIZER_DEVICES:
            raise ValueError(f"Offload: optimizer_device={self.optimizer_device!r}; valid choices: "
                             f"{', '.join(OPTIMIZER_DEVICES)}")
        if self.param_device not in PARAM_DEVICES:
            raise ValueError(f"Offload: param_device={self.param_device!r}; valid choices: "
                             f"{', '.join(PARAM_DEVICES)}")
        if self.param_device != "none" and self.stage != 3:
            raise ValueError(f"Offload: param_device={self.param_device!r} needs stage=3 (only ZeRO-3 "
                             f"partitions the parameters); got stage={self.stage}. Valid with "
                             f"stage={self.stage}: param_device='none'")
        if self.uses_nvme:
            if not isinstance(self.nvme_path, str) or not self.nvme_path:
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r} must name a directory when "
                                 f"optimizer_device={self.optimizer_device!r} and "
                                 f"param_device={self.param_device!r} (a device is 'nvme')")
            if os.path.exists(self.nvme_path) and not os.path.isdir(self.nvme_path):
                raise ValueError(f"Offload: nvme_path={self.nvme_path!r} exists and is not a directory")
        for f, low in (("buffer_count", 1), ("sub_group_size", 1), ("io_threads", 1)):
            if getattr(self, f) < low:
                raise ValueError(f"Offload: {f}={getattr(self, f)!r} must be >= {low}")
        if self.io_block_size < ALIGN or self.io_block_size % ALIGN:
            raise ValueError(f"Offload: io_block_size={self.io_block_size!r} must be a positive "
                             f"multiple of {ALIGN} bytes")

    @property
    def uses_nvme(self) -> bool:
        return self.optimizer_device == "nvme" or self.param_device == "nvme"

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
