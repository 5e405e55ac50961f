"""Lightning's ``BasePredictionWriter`` (``lightning.pytorch.callbacks.prediction_writer``): a
callback that hands ``predict``'s outputs to the user's ``write_on_batch_end`` after each batch
and/or ``write_on_epoch_end`` after the epoch, so predictions can go to disk instead of memory.
``batch_indices``: the dataset indices of the batch (``write_on_batch_end``) or, per loader, of
every batch (``write_on_epoch_end``), as Lightning's ``trainer.predict_loop`` keeps them
(``trainer/data/predict_indices.py``; empty where a loader has none, e.g. an ``IterableDataset``)."""
from __future__ import annotations

from typing import Any

from .base import Callback

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in _INTERVALS:
            raise ValueError(f"BasePredictionWriter: write_interval={write_interval!r}; valid choices: "
                             f"{', '.join(_INTERVALS)}")
        self.interval = write_interval
        self._predictions: dict[int, list] = {}

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        raise NotImplementedError

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        raise NotImplementedError

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._predictions = {}

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        if self.interval in ("batch", "batch_and_epoch"):
            self.write_on_batch_end(trainer, pl_module, outputs, trainer.predict_loop.current_batch_indices, batch,
                                    batch_idx, dataloader_idx)
        if self.interval in ("epoch", "batch_and_epoch"):
            self._predictions.setdefault(dataloader_idx, []).append(outputs)

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.interval not in ("epoch", "batch_and_epoch"):
            return
        per_loader = [self._predictions[k] for k in sorted(self._predictions)]
        predictions = per_loader[0] if len(per_loader) == 1 else per_loader
        self.write_on_epoch_end(trainer, pl_module, predictions, trainer.predict_loop.epoch_batch_indices)
        self._predictions = {}
