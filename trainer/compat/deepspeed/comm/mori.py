"""``deepspeed.comm.mori``: DeepSpeed's switch for AMD's SDMA all-gather (the ``mori`` package on
ROCm, opted into with ``DS_SDMA_ALLGATHER=1``). zerotrain has no SDMA path: its ZeRO-3 gathers go
through torch.distributed, which is what DeepSpeed falls back to whenever SDMA is unavailable, so the
handle is never enabled and the numbers are the same as DeepSpeed's with the switch off.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("zerotrain")
_warned = False


def init(max_numel: int = 64 * 1024 * 1024) -> None:
    """Nothing to build; with ``DS_SDMA_ALLGATHER`` set, say once that the gathers use
    torch.distributed (DeepSpeed logs the same fallback when mori is missing)."""
    global _warned
    if os.environ.get("DS_SDMA_ALLGATHER", "0").lower() in ("1", "true", "yes", "on") and not _warned:
        _warned = True
        log.warning("zerotrain.deepspeed.comm.mori: DS_SDMA_ALLGATHER is set but zerotrain has no SDMA all-gather; "
                    "ZeRO-3 gathers use torch.distributed (as DeepSpeed without mori)")


def is_enabled() -> bool:
    """Whether the SDMA handle exists: never here."""
    return False


def supports(input_tensor: torch.Tensor, group: Any = None) -> bool:
    """Whether a gather could take the SDMA path: never here."""
    return False


def allgather_into_tensor(input_tensor: torch.Tensor, output_tensor: torch.Tensor, group: Any = None) -> None:
    """``None``: the caller gathers through torch.distributed, as DeepSpeed's callers do on ``None``."""
    return None
