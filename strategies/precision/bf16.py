"""bfloat16 plugins. bf16 has fp32's exponent range, so no loss scaling is needed."""
from __future__ import annotations

from typing import Any

import torch

from .base import Precision, cast_floating


class BF16Mixed(Precision):
    """Autocast to bf16; replicated strategies keep fp32 params, sharded ones bf16 working params
    with fp32 master slices."""

    name = "bf16-mixed"
    param_dtype = torch.bfloat16
    autocast_dtype = torch.bfloat16


class BF16True(Precision):
    """Everything in bf16, including the optimizer's view of the parameters."""

    name = "bf16-true"
    param_dtype = torch.bfloat16
    autocast_dtype = None

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16)

    def convert_input(self, batch: Any) -> Any:
        return cast_floating(batch, torch.bfloat16)
