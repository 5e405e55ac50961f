"""Which dataset indices each ``predict`` batch came from, as Lightning tracks them for its
``BasePredictionWriter`` (``batch_indices`` in ``write_on_batch_end`` / ``write_on_epoch_end``).

``predict``'s map-style DataLoaders run over an ``IndexBatchSampler``: their batch sampler,
recording each batch of indices it hands out (Lightning's ``_IndexBatchSamplerWrapper``, whose
name ``trainer/compat`` gives this class). The Trainer reads the record by ``batch_idx`` - so a
loader's workers may fetch ahead - and keeps it on ``trainer.predict_loop``:
``current_batch_indices`` (the running batch's) and ``epoch_batch_indices`` (per loader, per
batch). A loader that is not a DataLoader, or holds an ``IterableDataset``, has no indices: the
writer gets an empty list, as Lightning's does.
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset

from ..launch.job import loader_options


class IndexBatchSampler:
    """A batch sampler that yields ``batch_sampler``'s batches unchanged and records them in
    ``seen_batch_indices`` (reset at each pass)."""

    def __init__(self, batch_sampler: Any) -> None:
        self.seen_batch_indices: list[list[int]] = []
        self._batch_sampler = batch_sampler
        self._iterator: Iterator[Any] | None = None

    @property
    def batch_sampler(self) -> Any:
        return self._batch_sampler

    @property
    def sampler(self) -> Any:
        """The wrapped batch sampler's sampler (what DataLoader users read as ``batch_sampler.sampler``)."""
        return getattr(self._batch_sampler, "sampler", None)

    @property
    def batch_size(self) -> Any:
        return getattr(self._batch_sampler, "batch_size", None)

    @property
    def drop_last(self) -> Any:
        return getattr(self._batch_sampler, "drop_last", False)

    def __iter__(self) -> "IndexBatchSampler":
        self.seen_batch_indices = []
        self._iterator = iter(self._batch_sampler)
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            raise TypeError("IndexBatchSampler: call iter() before next()")
        batch = next(self._iterator)
        self.seen_batch_indices.append(list(batch))
        return batch

    def __len__(self) -> int:
        return len(self._batch_sampler)


def with_index_tracking(loader: Any) -> Any:
    """``loader`` rebuilt over an ``IndexBatchSampler`` of its batch sampler (the same dataset,
    batches and options); anything without indices to track is returned as it is."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_sampler is None or isinstance(loader.batch_sampler, IndexBatchSampler):
        return loader
    options = loader_options(loader)
    for name in ("batch_size", "drop_last"):  # they belong to the batch sampler now
        options.pop(name)
    return DataLoader(loader.dataset, batch_sampler=IndexBatchSampler(loader.batch_sampler),
                      generator=loader.generator, **options)


def batch_indices(loader: Any, batch_idx: int) -> list[int]:
    """The dataset indices of batch ``batch_idx`` of the running pass over ``loader`` ([] when
    they are not tracked)."""
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, IndexBatchSampler) or batch_idx >= len(sampler.seen_batch_indices):
        return []
    return sampler.seen_batch_indices[batch_idx]
