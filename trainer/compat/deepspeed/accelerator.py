"""``deepspeed.accelerator.get_accelerator()``: the device calls scripts make through DeepSpeed's
accelerator abstraction, answered by torch for the two devices zerotrain trains on (CUDA, CPU).

Which one: ``DS_ACCELERATOR`` ("cuda" or "cpu") when set, as DeepSpeed reads it; otherwise CUDA
when torch sees a GPU, else the CPU.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ...errors import ConfigError

ACCELERATORS = ("cuda", "cpu")


class Accelerator:
    """One device kind's answers; the method names are DeepSpeed's."""

    def __init__(self, name: str) -> None:
        self._name = name

    # ------------------------------------------------------------------ identity
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def device_count(self) -> int:
        """CUDA: the GPUs torch sees. CPU: ``LOCAL_SIZE`` when set above 0, as DeepSpeed's CPU
        accelerator counts its devices (its launcher sets it to the ranks per node), else the
        ranks per node torchrun gives (``LOCAL_WORLD_SIZE``), else 1."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            if int(os.environ.get(key, "0") or 0) > 0:
                return int(os.environ[key])
        return 1

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    # ------------------------------------------------------------------ random numbers
    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._name == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or 0) if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(state, device_index or 0)
        else:
            torch.set_rng_state(state)

    # ------------------------------------------------------------------ execution and memory
    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"


_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process (chosen once: ``DS_ACCELERATOR``, else CUDA if present)."""
    global _current
    if _current is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in ACCELERATORS:
            raise ConfigError(f"DS_ACCELERATOR={name!r}: not an accelerator zerotrain runs on; valid: "
                              f"{', '.join(ACCELERATORS)}")
        _current = Accelerator(name)
    return _current


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one the face runs on (DeepSpeed's question of its own
    list; both of zerotrain's, CUDA and CPU, are on DeepSpeed's)."""
    return get_accelerator().device_name() in ACCELERATORS


def set_accelerator(accelerator: Any) -> None:
    """Use ``accelerator`` (an :class:`Accelerator`) from now on, as DeepSpeed's ``set_accelerator``."""
    global _current
    if not isinstance(accelerator, Accelerator):
        raise ConfigError(f"set_accelerator: accelerator={accelerator!r}; valid: an Accelerator "
                          "(Accelerator('cuda') or Accelerator('cpu'))")
    _current = accelerator
