"""Activation memory as autograd holds it: the bytes of the distinct storages saved for backward
during a forward (``torch.autograd.graph.saved_tensors_hooks``), parameters left out. What the
activation term of the mesh estimate (``mesh.py``) is checked against, rather than RSS, which the
allocator's caching and the optimizer's buffers blur.

    with SavedActivations(model) as saved:
        loss = model(x).sum()
    saved.bytes  # held until backward frees them
"""
from __future__ import annotations

import torch
from torch import nn


class SavedActivations:
    """Counts each storage saved for backward once (views of one tensor share it); a storage
    that belongs to a parameter of ``module`` at the moment it is saved (a weight, or a view of a
    gathered parameter buffer) is not an activation and is left out. ``bytes``, ``count``."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self.module = module
        self.bytes = 0
        self.count = 0
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _param_storages(self) -> set[int]:
        if self.module is None:
            return set()
        return {p.untyped_storage().data_ptr() for p in self.module.parameters() if p.device.type != "meta"}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        if st.nbytes() and key not in self._seen and key not in self._param_storages():
            self._seen.add(key)
            self.bytes += st.nbytes()
            self.count += 1
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
