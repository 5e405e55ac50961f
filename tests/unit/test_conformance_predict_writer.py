"""``predict``'s batch indices as Lightning's ``BasePredictionWriter`` gets them (issue 41;
Lightning's trainer/test_trainer.py::test_trainer_predict_cpu): each batch's dataset indices in
``write_on_batch_end``, per loader and batch in ``write_on_epoch_end``, none for an iterable
dataset; and ``trainer._accelerator_connector.is_distributed``, which such writers read."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from zerotrain import Trainer
from zerotrain.callbacks import BasePredictionWriter
from zerotrain.demos.boring_classes import BoringModel, RandomDataset, RandomIterableDataset


def _writer(base):
    class Recorder(base):
        def __init__(self):
            super().__init__(write_interval="batch_and_epoch")
            self.batches, self.epoch = [], None

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.batches.append((dataloader_idx, list(batch_indices)))

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epoch = [[list(b) for b in per_loader] for per_loader in batch_indices]

    return Recorder()


def _loaders(shuffle=True):
    generator = torch.Generator().manual_seed(5)
    return [DataLoader(RandomDataset(32, 7), batch_size=3),
            DataLoader(RandomDataset(32, 5), batch_size=2, shuffle=shuffle, generator=generator)]


def _predict(trainer_cls, writer_base, model, loaders):
    writer = _writer(writer_base)
    trainer = trainer_cls(callbacks=[writer], logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.predict(model, dataloaders=loaders)
    return writer, trainer


def test_batch_indices_reach_the_writer():
    writer, _ = _predict(Trainer, BasePredictionWriter, BoringModel(), _loaders())
    first = [indices for idx, indices in writer.batches if idx == 0]
    assert first == [[0, 1, 2], [3, 4, 5], [6]]
    second = [indices for idx, indices in writer.batches if idx == 1]
    assert sorted(i for b in second for i in b) == [0, 1, 2, 3, 4]  # shuffled: every index once
    assert writer.epoch == [first, second]


def test_batch_indices_as_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as TheirModel

    # in order: a shuffled loader's order on one process is another matter (trainer/data/loaders.py)
    ours, _ = _predict(Trainer, BasePredictionWriter, BoringModel(), _loaders(shuffle=False))
    theirs, _ = _predict(pl.Trainer, pl.callbacks.BasePredictionWriter, TheirModel(), _loaders(shuffle=False))
    assert ours.batches == theirs.batches
    assert ours.epoch == theirs.epoch


def test_iterable_dataset_has_no_indices():
    writer, _ = _predict(Trainer, BasePredictionWriter, BoringModel(), DataLoader(RandomIterableDataset(32, 3)))
    assert writer.batches == [(0, []), (0, []), (0, [])]


def test_accelerator_connector_is_distributed():
    assert Trainer(logger=False)._accelerator_connector.is_distributed is False
    assert Trainer(logger=False, strategy="ddp", devices=1)._accelerator_connector.is_distributed is True
