"""Precision plugins, chosen by name: "32", "bf16-mixed", "bf16-true", "16-mixed"."""
from __future__ import annotations

from .base import Precision
from .bf16 import BF16Mixed, BF16True
from .fp16 import DynamicLossScaler, FP16Mixed, LossScaleError

PRECISIONS = {"32": Precision, "bf16-mixed": BF16Mixed, "bf16-true": BF16True, "16-mixed": FP16Mixed}
_ALIASES = {"32-true": "32", "fp32": "32", "16": "16-mixed", "bf16": "bf16-mixed"}


def precision_from_name(name: "str | int | Precision") -> Precision:
    if isinstance(name, Precision):
        return name
    key = _ALIASES.get(str(name), str(name))
    if key not in PRECISIONS:
        raise ValueError(
            f"precision={name!r} is not supported; valid choices: {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[key]()


__all__ = ["Precision", "BF16Mixed", "BF16True", "FP16Mixed", "DynamicLossScaler", "LossScaleError",
           "PRECISIONS", "precision_from_name"]
