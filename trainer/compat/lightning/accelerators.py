"""Lightning's accelerator classes (``lightning.pytorch.accelerators``): zerotrain picks its device
from ``Trainer(accelerator=...)`` itself and has no accelerator objects in its loop; these answer
Lightning's class-level questions (is the device there, how many, which devices ``devices`` means)
for code that asks them, and ``trainer.accelerator`` is one of them."""
from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """The device kind a run uses."""

    #: the ``Trainer(accelerator=...)`` name
    name = ""

    def setup_device(self, device: torch.device) -> None:
        """Nothing to set up (zerotrain's strategies place the module themselves)."""

    def teardown(self) -> None:
        """Nothing to release."""

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return {}

    @staticmethod
    def is_available() -> bool:
        raise NotImplementedError

    @staticmethod
    def auto_device_count() -> int:
        raise NotImplementedError

    @staticmethod
    def parse_devices(devices: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        """Equal to its ``Trainer(accelerator=...)`` name ("cpu", "cuda"), which ``trainer.accelerator``
        was before it became this object, and to an accelerator of the same class."""
        if isinstance(other, str):
            return other == self.name
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _count(devices: Any, name: str) -> int:
    """``devices`` as a number of devices: an int, a digit string, or a list of indices."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    raise ValueError(f"{name}: devices={devices!r}; valid: a positive integer, its string, or a list of indices")


class CPUAccelerator(Accelerator):
    name = "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> int:
        return _count(devices, "CPUAccelerator")

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cpu")] * _count(devices, "CPUAccelerator")


class CUDAAccelerator(Accelerator):
    name = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        if isinstance(devices, (list, tuple)):
            return [int(d) for d in devices]
        if devices in (-1, "-1"):
            return list(range(torch.cuda.device_count()))
        return list(range(_count(devices, "CUDAAccelerator")))

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cuda", i) for i in CUDAAccelerator.parse_devices(devices)]


def accelerator_for(flag: str) -> Accelerator:
    """The accelerator a Trainer's ``accelerator`` flag ("cpu", "cuda", "auto") runs on: "auto" is
    CUDA where torch sees a device, else the CPU (as the ranks pick their device)."""
    if flag == "cuda" or (flag == "auto" and CUDAAccelerator.is_available()):
        return CUDAAccelerator()
    return CPUAccelerator()


__all__ = ["Accelerator", "CPUAccelerator", "CUDAAccelerator", "accelerator_for"]
