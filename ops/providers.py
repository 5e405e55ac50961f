"""Which Adam kernel providers this process can use (``zerotrain-report`` prints them).

* ``native``: zerotrain's own kernels (CPU always; CUDA where torch sees a GPU and a toolkit); the
  offload strategies step with them. ``ZEROTRAIN_BUILD_OPS=0`` makes them use ``torch`` instead.
* ``torch``:  torch's fused Adam/AdamW (always present).
* ``apex``:   NVIDIA apex's ``FusedAdam`` (CUDA only). Detected, never depended on: the PyPI
  package named ``apex`` is an unrelated project, so we require NVIDIA's layout, its compiled
  multi-tensor extension ``amp_C``, and a CUDA device.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch


def apex_fused_adam_available() -> bool:
    """True if NVIDIA apex's FusedAdam can run here (never imports anything when apex is absent)."""
    try:
        if importlib.util.find_spec("apex") is None:
            return False
        if importlib.util.find_spec("apex.optimizers") is None:
            return False
    except (ImportError, ValueError):
        return False
    if not torch.cuda.is_available():
        return False
    try:
        optimizers = importlib.import_module("apex.optimizers")
        fused_adam = getattr(optimizers, "FusedAdam", None)
        if fused_adam is None or not isinstance(fused_adam, type):
            return False
        if not issubclass(fused_adam, torch.optim.Optimizer):
            return False
        # NVIDIA's FusedAdam calls into amp_C (built with apex's --cuda_ext).
        return importlib.util.find_spec("amp_C") is not None
    except Exception:  # noqa: BLE001 - a foreign or broken "apex" must not break training
        return False


def available_providers() -> list[str]:
    """Providers usable here, preferred first."""
    providers = ["native", "torch"]
    if apex_fused_adam_available():
        providers.append("apex")
    return providers
