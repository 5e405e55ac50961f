"""DeepSpeed 0.19.8's finer precision keys: ``bf16.bf16_master_weights_and_grads``,
``bf16.bf16_optimizer_states``, ``fp16.fp16_master_weights_and_grads`` and the ``torch_autocast``
section.

* ``bf16_master_weights_and_grads`` (ZeRO 1-3 only) and ``bf16_optimizer_states`` (only with it):
  DeepSpeed then keeps this rank's master partition and its gradient in bf16 and steps it there
  (with bf16 moments, or, without ``bf16_optimizer_states``, only under ZeRO-Offload with
  DeepSpeedCPUAdam's fp32 moments). zerotrain's ZeRO keeps fp32 masters, gradients and moments for
  16-bit weights (``strategies/zero/flat_buffer.py``, ``sharded_optimizer.py``; its CPU Adam kernel
  steps fp32 masters), so a run with either key true would train differently from DeepSpeed's: both
  are refused (after DeepSpeed's own rules for them); false, DeepSpeed's default, is what runs.
  ``fp16_master_weights_and_grads`` likewise (fp16 master partitions, under offload);
* ``torch_autocast``: DeepSpeed runs the engine's forward under ``torch.autocast(device, dtype)``
  (``enabled``, ``dtype`` in DeepSpeed's spellings); ``lower_precision_safe_modules`` picks the
  parameters whose gradients DeepSpeed reduces in that type; zerotrain reduces all of them in one type
  (``communication_data_type``), so the key is reported as ignored.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ...errors import ConfigError

#: DeepSpeed's DtypeEnum spellings
_DTYPES = {**dict.fromkeys(("torch.float16", "fp16", "float16", "half"), torch.float16),
           **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), torch.float32),
           **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), torch.bfloat16)}


def check_bf16_keys(raw: Mapping[str, Any], key: str, flag: Any) -> None:
    """DeepSpeed's rules for the two keys (its config asserts them whether or not bf16 is enabled),
    then a refusal of either one true: zerotrain has no bf16 master weights (module docstring)."""
    section, zero = raw.get(key) or {}, raw.get("zero_optimization") or {}
    if not isinstance(section, Mapping):
        return  # the caller names the malformed section
    zero_stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    master = flag(f"{key}.bf16_master_weights_and_grads", section.get("bf16_master_weights_and_grads", False))
    states = flag(f"{key}.bf16_optimizer_states", section.get("bf16_optimizer_states", False))
    if states and not master:
        raise ConfigError(f"{key}.bf16_optimizer_states=True without {key}.bf16_master_weights_and_grads; valid: "
                          "both true, or bf16_optimizer_states false (DeepSpeed's rule)")
    if master and zero_stage not in (1, 2, 3):
        raise ConfigError(f"{key}.bf16_master_weights_and_grads=True: zero_optimization.stage={zero_stage}; valid: "
                          "stage 1, 2 or 3 (DeepSpeed's rule)")
    for name, on in (("bf16_master_weights_and_grads", master), ("bf16_optimizer_states", states)):
        if on:
            raise ConfigError(f"{key}.{name}=True: not implemented (zerotrain's ZeRO keeps fp32 master weights, "
                              "gradients and optimizer states, so the run would differ from DeepSpeed's bf16 "
                              "ones); valid: false (DeepSpeed's default)")


def check_fp16_master_key(raw: Mapping[str, Any], flag: Any) -> None:
    """``fp16.fp16_master_weights_and_grads``: true, DeepSpeed 0.19.8 keeps fp16 master partitions
    (ZeRO 1-3 under offload with DeepSpeedCPUAdam, whether or not ``fp16.enabled``); refused as the
    bf16 keys are, after DeepSpeed's stage rule."""
    section, zero = raw.get("fp16") or {}, raw.get("zero_optimization") or {}
    if not isinstance(section, Mapping) or not flag("fp16.fp16_master_weights_and_grads",
                                                    section.get("fp16_master_weights_and_grads", False)):
        return
    zero_stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"fp16.fp16_master_weights_and_grads=True: zero_optimization.stage={zero_stage}; valid: "
                          "stage 1, 2 or 3 (DeepSpeed's rule)")
    raise ConfigError("fp16.fp16_master_weights_and_grads=True: not implemented (zerotrain's ZeRO keeps fp32 master "
                      "weights, gradients and optimizer states, so the run would differ from DeepSpeed's fp16 "
                      "ones); valid: false (DeepSpeed's default)")


def torch_autocast_dtype(raw: Mapping[str, Any], flag: Any, ignored: list[str]) -> torch.dtype | None:
    """The ``torch_autocast`` section: the autocast type of the engine's forward, or None."""
    section = raw.get("torch_autocast")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"torch_autocast={section!r}: not a section; valid: {{\"enabled\": true, \"dtype\": "
                          "\"bfloat16\"}")
    unknown = sorted(set(section) - {"enabled", "dtype", "lower_precision_safe_modules"})
    ignored.extend(f"torch_autocast.{k} (unknown)" for k in unknown)
    if "lower_precision_safe_modules" in section:
        ignored.append("torch_autocast.lower_precision_safe_modules (gradients are reduced in one type)")
    if not flag("torch_autocast.enabled", section.get("enabled", False)):
        return None
    name = section.get("dtype")
    if name is None:  # DeepSpeed passes dtype=None: torch's default autocast type of the device
        from .accelerator import get_accelerator

        return torch.get_autocast_dtype(get_accelerator().device_name())
    if not isinstance(name, str) or name not in _DTYPES:
        raise ConfigError(f"torch_autocast.dtype={name!r}: not a DeepSpeed dtype name; valid: "
                          f"{', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]
