"""DeepSpeed 0.19.8's finer precision keys: ``bf16.bf16_master_weights_and_grads``,
``bf16.bf16_optimizer_states``, ``fp16.fp16_master_weights_and_grads`` and the ``torch_autocast``
section.

* ``bf16_master_weights_and_grads`` (ZeRO 1-3 only) and ``bf16_optimizer_states`` (only with it):
  DeepSpeed then keeps this rank's master partition and its gradient in bf16 and steps it there,
  with bf16 moments (the optimizer makes its state like its parameters) or, without
  ``bf16_optimizer_states``, only under ZeRO-Offload with DeepSpeedCPUAdam's fp32 moments. Both
  true is ZeRO's ``master_dtype="bf16"`` here (the working bf16 partition is the master, stepped in
  place by the user's optimizer; under ``offload_optimizer.device="cpu"`` by the fused host Adam
  kernel in fp32, rounded once, as DeepSpeedCPUAdam); fp32 moments beside bf16 masters and NVMe are
  refused as not implemented, every combination DeepSpeed refuses with its rule.
  ``fp16_master_weights_and_grads``: DeepSpeed keeps fp16 masters only under offload: refused;
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


def _zero_stage_and_offload(raw: Mapping[str, Any]) -> tuple[Any, str | None]:
    """The ZeRO stage and the optimizer's offload device (None: no offload)."""
    zero = raw.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return 0, None
    section = zero.get("offload_optimizer") or {}
    device = section.get("device", "none") if isinstance(section, Mapping) else "none"
    return zero.get("stage", 0), device if device in ("cpu", "nvme") else None


def check_bf16_keys(raw: Mapping[str, Any], key: str, flag: Any, bf16_on: bool) -> str | None:
    """DeepSpeed's rules for the two keys (its config asserts them whether or not bf16 is enabled;
    its ZeRO optimizers' ``_configure_master_weights``: without ``bf16_optimizer_states``, or under
    offload, the masters need ZeRO-Offload with DeepSpeedCPUAdam); "bf16" when the masters are
    bf16 (ZeRO's ``master_dtype``), None when they stay fp32."""
    section = raw.get(key) or {}
    if not isinstance(section, Mapping):
        return None  # the caller names the malformed section
    zero_stage, offload = _zero_stage_and_offload(raw)
    master = flag(f"{key}.bf16_master_weights_and_grads", section.get("bf16_master_weights_and_grads", False))
    states = flag(f"{key}.bf16_optimizer_states", section.get("bf16_optimizer_states", False))
    if states and not master:
        raise ConfigError(f"{key}.bf16_optimizer_states=True without {key}.bf16_master_weights_and_grads; valid: "
                          "both true, or bf16_optimizer_states false (DeepSpeed's rule)")
    if not master:
        return None
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"{key}.bf16_master_weights_and_grads=True: zero_optimization.stage={zero_stage}; valid: "
                          "stage 1, 2 or 3 (DeepSpeed's rule)")
    fp16 = raw.get("fp16") or {}
    if isinstance(fp16, Mapping) and flag("fp16.fp16_master_weights_and_grads",
                                          fp16.get("fp16_master_weights_and_grads", False)):
        raise ConfigError(f"fp16.fp16_master_weights_and_grads=True with {key}.bf16_master_weights_and_grads=True: "
                          "mutually exclusive (DeepSpeed's rule); valid: at most one of them")
    if not states and not offload:
        raise ConfigError(f"{key}.bf16_master_weights_and_grads=True without {key}.bf16_optimizer_states and "
                          "without zero_optimization.offload_optimizer: fp32 optimizer states beside bf16 masters "
                          "need ZeRO-Offload with DeepSpeedCPUAdam (DeepSpeed's rule); valid: bf16_optimizer_states "
                          "true, or offload_optimizer.device cpu")
    if offload and (offload != "cpu" or not states):
        what = (f"offload_optimizer.device={offload!r} (16-bit masters are stepped in host RAM only)" if states else
                "fp32 moments beside bf16 masters (DeepSpeedCPUAdam's fp32_optimizer_states)")
        raise ConfigError(f"{key}.bf16_master_weights_and_grads=True under zero_optimization.offload_optimizer: "
                          f"{what} not implemented; valid: bf16_optimizer_states true with offload_optimizer.device "
                          "cpu or without offload_optimizer")
    if not bf16_on:
        raise ConfigError(f"{key}.bf16_master_weights_and_grads=True with {key}.enabled false: zerotrain's 16-bit "
                          f"masters are the working bf16 partitions; valid: {key}.enabled true")
    return "bf16"


def check_fp16_master_key(raw: Mapping[str, Any], flag: Any) -> None:
    """``fp16.fp16_master_weights_and_grads``: true, DeepSpeed 0.19.8 keeps fp16 master partitions
    and always requires ZeRO-Offload with DeepSpeedCPUAdam for them (``_configure_master_weights``,
    whether or not ``fp16.enabled``), with fp32 moments: refused after DeepSpeed's rules (zerotrain's
    16-bit masters keep moments of their own type)."""
    section = raw.get("fp16") or {}
    if not isinstance(section, Mapping) or not flag("fp16.fp16_master_weights_and_grads",
                                                    section.get("fp16_master_weights_and_grads", False)):
        return
    zero_stage, offload = _zero_stage_and_offload(raw)
    if zero_stage not in (1, 2, 3):
        raise ConfigError(f"fp16.fp16_master_weights_and_grads=True: zero_optimization.stage={zero_stage}; valid: "
                          "stage 1, 2 or 3 (DeepSpeed's rule)")
    if not offload:
        raise ConfigError("fp16.fp16_master_weights_and_grads=True without zero_optimization.offload_optimizer: "
                          "fp16 masters need ZeRO-Offload with DeepSpeedCPUAdam (DeepSpeed's rule); valid: "
                          "offload_optimizer.device cpu, or false")
    raise ConfigError("fp16.fp16_master_weights_and_grads=True with zero_optimization.offload_optimizer: not "
                      "implemented (DeepSpeedCPUAdam keeps fp32 moments beside the fp16 masters; zerotrain's 16-bit "
                      "masters keep moments of their own type); valid: false (DeepSpeed's default)")


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
