"""Precision plugins, chosen by name: "32", "bf16-mixed", "bf16-true", "16-mixed", "64-true", or one of
Lightning's aliases for them (16, "16", "bf16", "32-true", ...).

May import: trainer.errors."""
from __future__ import annotations

from .base import Precision
from .bf16 import BF16Mixed, BF16True
from .double import Double
from .fp16 import DynamicLossScaler, FP16Mixed, LossScaleError

PRECISIONS = {"32": Precision, "bf16-mixed": BF16Mixed, "bf16-true": BF16True, "16-mixed": FP16Mixed,
              "64-true": Double}
_ALIASES = {"32-true": "32", "fp32": "32", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
#: every accepted name, canonical ones first
CHOICES = tuple(PRECISIONS) + tuple(_ALIASES)
#: Lightning names with no zerotrain plugin, and why
_UNSUPPORTED = {"16-true": "no pure fp16 training (use 16-mixed or bf16-true)",
                "transformer-engine": "no Transformer Engine (fp8) support"}


def canonical_precision(name: "str | int", field: str = "precision") -> str:
    """The canonical name ("32", "16-mixed", ...) of an accepted precision name or alias; a
    ValueError naming ``field``, the value and the choices for anything else."""
    key = _ALIASES.get(str(name), str(name)) if isinstance(name, (str, int)) and not isinstance(name, bool) else None
    if key not in PRECISIONS:
        why = f" ({_UNSUPPORTED[key]})" if key in _UNSUPPORTED else ""
        raise ValueError(f"{field}={name!r}: is not supported{why}; valid choices: {', '.join(CHOICES)}")
    return key


def precision_from_name(name: "str | int | Precision") -> Precision:
    if isinstance(name, Precision):
        return name
    return PRECISIONS[canonical_precision(name)]()


__all__ = ["Precision", "BF16Mixed", "BF16True", "Double", "FP16Mixed", "DynamicLossScaler", "LossScaleError",
           "PRECISIONS", "CHOICES", "canonical_precision", "precision_from_name"]
