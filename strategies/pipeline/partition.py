"""Pure partition math: which contiguous run of layers each pipeline stage owns.

A partition is a list of ``num_stages + 1`` boundaries ``[0, b1, ..., num_layers]``: stage ``s`` owns
layers ``bounds[s]:bounds[s + 1]``. Every stage owns at least one layer. Nothing here touches a
process group or builds a real layer, so it is unit-tested on its own.
"""
from __future__ import annotations

from typing import Sequence


def partition_uniform(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts that differ by at most one; the larger stages come last."""
    _check_sizes(num_layers, num_stages)
    return [s * num_layers // num_stages for s in range(num_stages + 1)]


def partition_balanced(weights: Sequence[int], num_stages: int) -> list[int]:
    """Contiguous stages whose largest total weight is as small as possible.

    Binary search on that largest total ``T``; for a given ``T`` a greedy pass packs each stage
    as full as ``T`` allows while leaving one layer for every stage still to come. Zero-weight
    layers (activations, dropout) are packed with the layers before them.
    """
    weights = [int(w) for w in weights]
    _check_sizes(len(weights), num_stages)
    if any(w < 0 for w in weights):
        raise ValueError(f"partition weights must be >= 0, got {weights}")
    lo, hi = max(weights), max(sum(weights), max(weights))
    while lo < hi:
        mid = (lo + hi) // 2
        if _stages_needed(weights, mid) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    return _pack(weights, num_stages, lo)


def _stages_needed(weights: list[int], cap: int) -> int:
    stages, total = 1, 0
    for w in weights:
        if total + w > cap:
            stages, total = stages + 1, 0
        total += w
    return stages


def _pack(weights: list[int], num_stages: int, cap: int) -> list[int]:
    n = len(weights)
    bounds, i = [0], 0
    for s in range(num_stages - 1):
        must_leave = num_stages - s - 1  # one layer for each later stage
        total = weights[i]
        i += 1
        while n - i > must_leave and total + weights[i] <= cap:
            total += weights[i]
            i += 1
        bounds.append(i)
    bounds.append(n)
    return bounds


def validate_boundaries(bounds: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Check an explicit partition and return it as a list."""
    bounds = [int(b) for b in bounds]
    ok = (len(bounds) == num_stages + 1 and bounds[0] == 0 and bounds[-1] == num_layers
          and all(a < b for a, b in zip(bounds, bounds[1:])))
    if not ok:
        raise ValueError(
            f"partition_method={bounds!r} is not a valid explicit partition of {num_layers} layers into "
            f"{num_stages} stages: give {num_stages + 1} strictly increasing boundaries from 0 to "
            f"{num_layers}, e.g. {partition_uniform(num_layers, num_stages)}")
    return bounds


def partition(weights: Sequence[int], num_stages: int, method: "str | Sequence[int]") -> list[int]:
    """Boundaries for ``method``: "parameters" (balance ``weights``), "uniform" (balance layer
    counts) or an explicit list of boundaries."""
    if isinstance(method, str):
        if method == "parameters":
            return partition_balanced(weights, num_stages)
        if method == "uniform":
            return partition_uniform(len(weights), num_stages)
        raise ValueError(f"partition_method={method!r}; valid choices: 'parameters', 'uniform', "
                         "or a list of stage boundaries")
    return validate_boundaries(method, len(weights), num_stages)


def stage_of_layer(bounds: Sequence[int], index: int) -> int:
    for s in range(len(bounds) - 1):
        if bounds[s] <= index < bounds[s + 1]:
            return s
    raise IndexError(f"layer {index} is outside the partition {list(bounds)}")


def _check_sizes(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be >= 1")
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill num_stages={num_stages}: every stage needs "
                         "at least one layer; use fewer stages or split the model into more layers")
