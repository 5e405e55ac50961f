"""``fit``'s training data as Lightning's fit loop takes it: one loader, or several iterated together.

Several training loaders are a list, tuple or dict of DataLoaders (in any nesting) or a
``CombinedLoader``; a collection is combined in Lightning's default training mode
``max_size_cycle`` (the shorter loaders start again until the longest ends), a ``CombinedLoader``
keeps its own mode (``sequential`` is refused when the epoch starts, as Lightning). Each loader is
prepared (sampler, worker checks, ``overfit_batches``) as a single one is, ``limit_train_batches``
applies to each and the epoch's length is theirs combined as the mode combines lengths.
``training_step`` gets the combined batch (the collection's nesting, one batch of each loader)
and ``trainer.train_dataloader`` is the collection of prepared loaders, as Lightning's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader

from ..compat.lightning.combined_loader import CombinedLoader

#: how a mode combines the lengths of its loaders (Lightning's)
_COMBINE = {"min_size": min, "max_size_cycle": max, "max_size": max, "sequential": sum}


class FitLoaders(CombinedLoader):
    """The training loaders of one ``fit``, iterated together: each step yields the combined
    batch only (no ``batch_idx``/``dataloader_idx``: the fit loop counts its batches)."""

    def limited_len(self, limit: Callable[[Any], float]) -> float:
        """The epoch's batches: ``limit`` (the Trainer's ``limit_train_batches`` rule) applied to
        each loader, combined by the mode (inf where a loader without a length decides it)."""
        return _COMBINE[self._mode]([limit(d) for d in self.flattened] or [0])

    def _steps(self) -> Iterator[tuple[Any, int, int]]:
        if self._mode == "sequential":
            modes = [m for m in _COMBINE if m != "sequential"]
            raise ValueError(f'`_FitLoop` does not support the `CombinedLoader(mode="sequential")` mode. '
                             f"The available modes are: {modes}")
        yield from super()._steps()

    def __next__(self) -> Any:
        return super().__next__()[0]


def is_collection(source: Any) -> bool:
    """Several training loaders: a ``CombinedLoader``, or a non-empty list/tuple/dict whose leaves
    are all DataLoaders (anything else, e.g. a list of batches, stays one iterable)."""
    if isinstance(source, CombinedLoader):
        return True
    if not isinstance(source, (list, tuple, dict)) or not source:
        return False
    leaves = tree_flatten(source)[0]
    return bool(leaves) and all(isinstance(d, DataLoader) for d in leaves)


def fit_loaders(source: Any, prepare: Callable[[Any], Any]) -> Any:
    """The training iterable of ``fit``: ``prepare(loader)`` for one loader, else a
    ``FitLoaders`` of each loader prepared (``max_size_cycle`` unless a CombinedLoader says)."""
    if not is_collection(source):
        return prepare(source)
    mode = source._mode if isinstance(source, CombinedLoader) else "max_size_cycle"
    iterables = source.iterables if isinstance(source, CombinedLoader) else source
    flat, spec = tree_flatten(iterables)
    return FitLoaders(tree_unflatten([prepare(d) for d in flat], spec), mode)
