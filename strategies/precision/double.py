"""float64 training (Lightning's ``precision="64-true"``, its ``DoublePrecision``): the module's
parameters and buffers in float64, the batch's floating-point tensors cast to float64, and every
forward run with float64 as torch's default dtype (tensors the step creates are float64 too).
The optimizer steps the float64 parameters themselves. Only strategies that keep the module
whole (``supports_float64``: single, ddp) take it; the sharded ones keep fp32 master weights."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .base import Precision, cast_floating


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` inside, restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class Double(Precision):
    name = "64-true"
    param_dtype = torch.float64

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.double()

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, torch.float64)

    def forward_context(self, device_type: str = "cpu") -> contextlib.AbstractContextManager:
        return default_dtype(torch.float64)
