"""Lightning's logger helpers (``lightning.fabric.utilities.logger``,
``lightning.pytorch.loggers.utilities``): hyperparameters as the flat, primitive dict a logger
writes, and which checkpoints a logger that uploads them has not uploaded yet."""
from __future__ import annotations

import dataclasses

from argparse import Namespace
from pathlib import Path
from typing import Any, MutableMapping

import torch

_PRIMITIVES = (bool, int, float, str, torch.Tensor)


def _convert_params(params: "dict[str, Any] | Namespace | None") -> dict[str, Any]:
    """``params`` as a dict: a Namespace's ``vars``, None as ``{}``."""
    if isinstance(params, Namespace):
        return vars(params)
    return {} if params is None else params


def _sanitize_callable_params(params: dict[str, Any]) -> dict[str, Any]:
    """Each class replaced by its name; each other callable value by what calling it without
    arguments returns, where that is a plain value, else by its name."""
    def sanitized(value: Any) -> Any:
        if isinstance(value, type):  # a class: its name, never an instance
            return value.__name__
        if not callable(value):
            return value
        try:
            out = value()
            if not callable(out):
                return out
        except Exception:
            pass
        return getattr(value, "__name__", value)

    return {k: sanitized(v) for k, v in params.items()}


def _flatten_dict(params: MutableMapping[Any, Any], delimiter: str = "/", parent_key: str = "") -> dict[str, Any]:
    """Nested dicts, Namespaces and dataclass instances flattened into one level, keys joined by
    ``delimiter``: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}``; a list of dicts is indexed
    (``{"l": [{"a": 1}]}`` -> ``{"l/0/a": 1}``), other lists stay values (Lightning's rule)."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent_key}{delimiter}{key}" if parent_key else str(key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        elif isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, MutableMapping):
            flat.update(_flatten_dict(value, delimiter, name))
        elif isinstance(value, list) and all(isinstance(item, MutableMapping) for item in value):
            for i, item in enumerate(value):
                flat.update(_flatten_dict(item, delimiter, f"{name}{delimiter}{i}"))
        else:
            flat[name] = value
    return flat


def _sanitize_params(params: dict[str, Any]) -> dict[str, Any]:
    """In place and returned: numpy scalars as Python numbers, anything but a bool, int, float, str
    or tensor as its ``str``."""
    try:
        import numpy as np

        numpy_scalars: tuple[type, ...] = (np.bool_, np.integer, np.floating)
    except ImportError:
        numpy_scalars = ()
    for key, value in params.items():
        if numpy_scalars and isinstance(value, numpy_scalars):
            value = params[key] = value.item()
        if type(value) not in _PRIMITIVES:
            params[key] = str(value)
    return params


def _add_prefix(metrics: dict[str, Any], prefix: str, separator: str) -> dict[str, Any]:
    """Every key as ``prefix + separator + key`` (unchanged without a prefix)."""
    return {f"{prefix}{separator}{k}": v for k, v in metrics.items()} if prefix else metrics


def _scan_checkpoints(checkpoint_callback: Any, logged_model_time: dict) -> list[tuple[float, str, Any, str]]:
    """The checkpoint files of ``checkpoint_callback`` (its last, best and top-k) that were not
    logged yet or changed since ``logged_model_time[path]``, oldest first, as
    ``(modification time, path, score, "latest" | "best" | "best_k")``."""
    found: dict[Any, tuple[Any, str]] = {}
    if hasattr(checkpoint_callback, "last_model_path") and hasattr(checkpoint_callback, "current_score"):
        found[checkpoint_callback.last_model_path] = (checkpoint_callback.current_score, "latest")
    if hasattr(checkpoint_callback, "best_model_path") and hasattr(checkpoint_callback, "best_model_score"):
        found[checkpoint_callback.best_model_path] = (checkpoint_callback.best_model_score, "best")
    for path, score in getattr(checkpoint_callback, "best_k_models", {}).items():
        found[path] = (score, "best_k")
    files = sorted((Path(p).stat().st_mtime, p, s, tag) for p, (s, tag) in found.items() if Path(p).is_file())
    return [c for c in files if c[1] not in logged_model_time or logged_model_time[c[1]] < c[0]]
