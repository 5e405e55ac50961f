"""Lightning's ``CombinedLoader`` (``lightning.pytorch.utilities.combined_loader``): several
iterables (in any nesting of lists, tuples and dicts) iterated together. Each step yields
``(batch, batch_idx, dataloader_idx)``; ``batch`` has the iterables' nesting with one batch of each:

* ``min_size``: until the shortest ends (length: the shortest);
* ``max_size_cycle``: until the longest ends, the shorter ones started again (the longest);
* ``max_size``: until the longest ends, an ended one giving None (the longest);
* ``sequential``: one iterable after the other, ``batch`` the current one's, ``batch_idx`` counted
  within it and ``dataloader_idx`` its position (the sum)."""
from __future__ import annotations

import itertools
from typing import Any, Iterator

from torch.utils._pytree import tree_flatten, tree_unflatten

MODES = ("min_size", "max_size_cycle", "max_size", "sequential")


def _len(iterable: Any) -> float:
    try:
        return len(iterable)
    except (TypeError, NotImplementedError):
        return float("inf")


class CombinedLoader:
    def __init__(self, iterables: Any, mode: str = "min_size") -> None:
        if mode not in MODES:
            raise ValueError(f"Unsupported mode {mode!r}, please select one of: {list(MODES)}.")
        self._iterables = iterables
        self._flattened, self._spec = tree_flatten(iterables)
        self._mode = mode
        self._iterator: Iterator | None = None

    @property
    def iterables(self) -> Any:
        return self._iterables

    @property
    def flattened(self) -> list:
        """The iterables, in the flattening order of their nesting."""
        return self._flattened

    @flattened.setter
    def flattened(self, flattened: list) -> None:
        if len(flattened) != len(self._flattened):
            raise ValueError(f"Mismatch in flattened length ({len(flattened)}) and existing length "
                             f"({len(self._flattened)})")
        self._iterables = tree_unflatten(flattened, self._spec)
        self._flattened = list(flattened)

    @property
    def sampler(self) -> Any:
        return tree_unflatten([getattr(d, "sampler", None) for d in self._flattened], self._spec)

    @property
    def batch_sampler(self) -> Any:
        return tree_unflatten([getattr(d, "batch_sampler", None) for d in self._flattened], self._spec)

    def _steps(self) -> Iterator[tuple[Any, int, int]]:
        if self._mode == "sequential":
            for k, iterable in enumerate(self._flattened):
                for i, batch in enumerate(iterable):
                    yield batch, i, k
            return
        if self._mode == "min_size":
            batches: Iterator = zip(*self._flattened)
        elif self._mode == "max_size":
            batches = itertools.zip_longest(*self._flattened)
        else:
            batches = self._cycled()
        for i, parts in enumerate(batches):
            yield tree_unflatten(list(parts), self._spec), i, 0

    def _cycled(self) -> Iterator[list]:
        """max_size_cycle: an iterable that ends starts again, until every one has ended once
        (the longest sets the length; works for iterables without a length too)."""
        iterators = [iter(d) for d in self._flattened]
        ended = [False] * len(iterators)
        while iterators:
            parts = []
            for i, d in enumerate(self._flattened):
                try:
                    parts.append(next(iterators[i]))
                except StopIteration:
                    ended[i] = True
                    if all(ended):
                        return
                    iterators[i] = iter(d)
                    try:
                        parts.append(next(iterators[i]))
                    except StopIteration:  # empty: the combination ends here, as Lightning's
                        return
            yield parts

    def __iter__(self) -> "CombinedLoader":
        self._iterator = self._steps()
        return self

    def __next__(self) -> tuple[Any, int, int]:
        if self._iterator is None:
            iter(self)
        return next(self._iterator)  # type: ignore[arg-type]

    def __len__(self) -> int:
        lengths = [_len(d) for d in self._flattened]
        if self._mode == "sequential":
            total = sum(lengths)
        elif self._mode == "min_size":
            total = min(lengths, default=0)
        else:
            total = max(lengths, default=0)
        if total == float("inf"):
            raise TypeError(f"{type(self).__name__} does not define `__len__`: one of its iterables has none")
        return int(total)

    def reset(self) -> None:
        self._iterator = None

    def _dataset_length(self) -> int:
        """The datasets' lengths combined as this mode combines the iterables'."""
        lengths = [_len(getattr(d, "dataset", d)) for d in self._flattened]
        combine = {"sequential": sum, "min_size": min}.get(self._mode, max)
        return int(combine(lengths, default=0))
