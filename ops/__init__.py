"""zerotrain's compiled optimizer ops, with pure-torch fallbacks.

* :func:`fused_adam_step`: one in-place Adam/AdamW step on a flat slice, one pass over memory
  (fp32 master, fp32/bf16/fp16 grad, fp32/bf16 state, optional bf16/fp16 parameter copy out).
* :class:`CPUAdam`: a ``torch.optim.Optimizer`` on top of it.
* :func:`build_all`: compile everything ahead of time into the cache, e.g.
  ``ZEROTRAIN_BUILD_OPS=1 python -c "import zerotrain.ops; zerotrain.ops.build_all()"``.
* :func:`kernel_info`: which implementation and SIMD path a step would use here.
* :func:`quantize_blockwise` / :func:`dequantize_blockwise`: block-wise int8 codes with one fp32
  scale per block (ZeRO++'s quantized communication; :mod:`zerotrain.ops.quantize`).

Ops are built on first use (see :mod:`zerotrain.ops.builder` for the cache and the
``ZEROTRAIN_BUILD_OPS`` / ``ZEROTRAIN_EXTENSIONS_DIR`` variables); without a compiler they fall
back, after one warning, to :mod:`zerotrain.ops.reference`.

May import: nothing."""
from __future__ import annotations

import os
from typing import Any

from .builder import CPU_ADAM, build_all, build_dir_of, cpu_adam_module, load_error
from .cpu_adam import CPUAdam, fused_adam_step
from .providers import apex_fused_adam_available, available_providers
from .quantize import dequantize_blockwise, quantize_blockwise

__all__ = [
    "CPUAdam",
    "fused_adam_step",
    "build_all",
    "kernel_info",
    "apex_fused_adam_available",
    "available_providers",
    "quantize_blockwise",
    "dequantize_blockwise",
]


def kernel_info() -> dict[str, Any]:
    """What :func:`fused_adam_step` runs on CPU tensors here (builds the op if needed).

    Keys: ``native`` (the compiled kernel loaded), ``provider`` ("native" or "torch"), ``isa``
    (the SIMD path a call would take now, honouring $ZEROTRAIN_ADAM_ISA; None for the fallback),
    ``supported_isas`` (best first), ``isa_override`` (the variable's value), ``build_dir`` and
    ``error`` (why the native op is unavailable, else None).
    """
    module = cpu_adam_module()
    override = os.environ.get("ZEROTRAIN_ADAM_ISA") or None
    info: dict[str, Any] = {
        "native": module is not None,
        "provider": "native" if module is not None else "torch",
        "isa": None,
        "supported_isas": [],
        "isa_override": override,
        "build_dir": build_dir_of(CPU_ADAM),
        "error": load_error(CPU_ADAM),
    }
    if module is not None:
        info["supported_isas"] = list(module.supported_isas())
        info["isa"] = module.selected_isa("")
    return info
