"""Memory: what a strategy holds, in bytes per category, counting each storage once (here), and
the host's RAM (``host.py``: glibc's mmap threshold, the free bytes per rank) and the ZeRO paper's
per-rank formula (``formula.py``), the same on a device mesh with the activations (``mesh.py``), and
the bytes autograd saves for backward (``saved.py``). Imports torch only.

Parameters that are views of one flat buffer share a storage and count once; a master slice that is
a view of the working buffer (fp32 ZeRO) counts under ``params`` only. Categories are visited in the
order of :data:`CATEGORIES` and a storage is charged to the first one that names it.

A strategy that knows its buffers implements ``memory_tensors() -> {category: [tensors]}``; any
other strategy is treated as replicated (parameters, their ``.grad`` and the optimizer's state).

May import: trainer.errors."""
from __future__ import annotations

from typing import Any, Iterable

import torch

#: params: working parameters (and frozen ones); grads: gradient buffers kept between backward and
#: step; master: fp32 master weights; optimizer: the optimizer's state; comm_buffers: pooled
#: communication buckets.
CATEGORIES = ("params", "grads", "master", "optimizer", "comm_buffers")


def replicated_tensors(strategy: Any) -> dict[str, list[torch.Tensor]]:
    module, optimizer = strategy.module, strategy.optimizer
    params = list(module.parameters()) if module is not None else []
    state = []
    if optimizer is not None:
        state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": state}


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (and not already in ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        key = (t.device, st.data_ptr())
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def count_bytes(strategy: Any) -> dict[str, int]:
    """Per-rank bytes in each of :data:`CATEGORIES`, plus ``total``."""
    get = getattr(strategy, "memory_tensors", None)
    tensors = get() if get is not None else replicated_tensors(strategy)
    unknown = set(tensors) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"memory_tensors() returned unknown categories {sorted(unknown)}")
    seen: set = set()
    out = {cat: storage_bytes(tensors.get(cat, []), seen) for cat in CATEGORIES}
    out["total"] = sum(out.values())
    return out
