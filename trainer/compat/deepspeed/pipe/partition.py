"""DeepSpeed 0.19.8's rules for cutting a ``PipelineModule`` into stages, as boundaries
``[0, b1, ..., num_layers]`` for ``strategies.pipeline`` (which owns the layers from there on).

The rules differ from ``strategies/pipeline/partition.py``'s on purpose: a script moved from
DeepSpeed must put every layer on the stage DeepSpeed puts it (a layer's dropout draws from that
process's random stream), so:

* ``"uniform"``: counts that differ by at most one, the larger stages FIRST;
* ``"parameters"``: each layer weighs its trainable parameters; ``"type:<regex>"``: a layer weighs
  1 when the regex matches its class name (case-insensitive search), else 0. Both choose, among
  all cuts into contiguous stages, one whose heaviest and lightest stage differ least; of equal
  cuts the one whose last boundaries lie furthest right;
* the weights of ``LayerSpec`` layers are counted by building each one for real, one at a time,
  as DeepSpeed does: that draws from the global random generator exactly as DeepSpeed's count
  does, so the layers each stage then builds get the same initial weights.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from torch import nn

from ....errors import ConfigError
from .....strategies.pipeline.module import LayerSpec

METHODS = "'parameters', 'uniform' or 'type:<regex>'"


def uniform(num_layers: int, num_stages: int) -> list[int]:
    """Boundaries for layer counts differing by at most one, the first stages the larger."""
    size, extra = divmod(num_layers, num_stages)
    return [s * size + min(s, extra) for s in range(num_stages + 1)]


def balanced(weights: Sequence[int], num_stages: int) -> list[int]:
    """The contiguous cut minimising (heaviest stage - lightest stage). Dynamic programming over
    prefixes: ``best[i][j]`` is the best cut of the first ``i`` layers into ``j`` stages, kept
    with its heaviest and lightest stage; a later split point replaces an equally good one."""
    n = len(weights)
    if n <= num_stages:
        return uniform(n, num_stages)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    cost = [[inf] * (num_stages + 1) for _ in range(n + 1)]
    heavy = [[inf] * (num_stages + 1) for _ in range(n + 1)]
    light = [[inf] * (num_stages + 1) for _ in range(n + 1)]
    split = [[0] * (num_stages + 1) for _ in range(n + 1)]
    cost[0][0] = heavy[0][0] = 0  # no layers in no stages; it has no lightest stage (inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_stages) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                hi, lo = max(heavy[k][j - 1], last), min(light[k][j - 1], last)
                if hi - lo <= cost[i][j]:
                    cost[i][j], heavy[i][j], light[i][j], split[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(num_stages, 0, -1):
        bounds.append(split[bounds[-1]][j])
    return bounds[::-1]


def trainable_parameters(layer: Any) -> int:
    """A layer's trainable parameters; a ``LayerSpec`` is built (for real) to count them."""
    module = layer.build() if isinstance(layer, LayerSpec) else layer
    if isinstance(module, nn.Module):
        return sum(p.numel() for p in module.parameters() if p.requires_grad)
    return 0


def _type_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return getattr(layer.typename, "__name__", None)
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def type_weights(layers: Sequence[Any], pattern: str) -> list[int]:
    """1 for each layer whose class (or function) name matches ``pattern``, else 0."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ConfigError(f"PipelineModule: partition_method='type:{pattern}': not a regular expression "
                          f"({err}); valid: {METHODS}") from None
    names = [_type_name(layer) for layer in layers]
    weights = [int(name is not None and regex.search(name) is not None) for name in names]
    if not any(weights):
        raise ConfigError(f"PipelineModule: partition_method='type:{pattern}' matches none of the layers "
                          f"{[n for n in names if n]}; valid: a regex matching at least one layer's class name")
    return weights


def boundaries(layers: Sequence[Any], num_stages: int, method: Any) -> list[int]:
    """Stage boundaries for ``method``, DeepSpeed's way (see the module docstring)."""
    if not isinstance(method, str):
        raise ConfigError(f"PipelineModule: partition_method={method!r}; valid: {METHODS}")
    lowered = method.lower()
    if lowered == "uniform":
        bounds = uniform(len(layers), num_stages)
    elif lowered == "parameters":
        bounds = balanced([trainable_parameters(layer) for layer in layers], num_stages)
    elif lowered.startswith("type:"):
        bounds = balanced(type_weights(layers, lowered.split(":")[1]), num_stages)  # as DeepSpeed reads it
    else:
        raise ConfigError(f"PipelineModule: partition_method={method!r}; valid: {METHODS}")
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"PipelineModule: partition_method={method!r} cuts {len(layers)} layers into "
                          f"{num_stages} stages as {bounds}, leaving a stage without layers; valid: at least "
                          f"num_stages={num_stages} layers")
    return bounds
