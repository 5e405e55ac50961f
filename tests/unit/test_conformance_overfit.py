"""``overfit_batches`` with a loader that does not sample in order (issue 41; Lightning's
trainer/flags/test_overfit_batches.py and test_dataloaders.py): as Lightning, the training and
validation loaders get a SequentialSampler over their dataset, with Lightning's warning."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel, RandomDataset


class InOrder(Sampler):  # in order, yet not a SequentialSampler
    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return iter(range(len(self.data)))

    def __len__(self):
        return len(self.data)


def _model(base, sampler):
    class Model(base):
        def train_dataloader(self):
            data = RandomDataset(32, 16)
            return DataLoader(data, sampler=sampler(data))

        def val_dataloader(self):
            data = RandomDataset(32, 16)
            return DataLoader(data, sampler=sampler(data))

    return Model()


def _fit(trainer_cls, model):
    trainer = trainer_cls(max_epochs=1, overfit_batches=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning) as record:
        trainer.fit(model)
    said = sorted({str(w.message) for w in record if "requested to overfit" in str(w.message)})
    return trainer, said


@pytest.mark.parametrize("sampler", [InOrder, lambda d: RandomSampler(d, generator=torch.Generator())])
def test_overfit_makes_the_loaders_sequential(sampler):
    trainer, said = _fit(Trainer, _model(BoringModel, sampler))
    assert isinstance(trainer.train_dataloader.sampler, SequentialSampler)
    assert isinstance(trainer.val_dataloaders.sampler, SequentialSampler)
    assert said == ["You requested to overfit but enabled train dataloader shuffling. We are turning off the train "
                    "dataloader shuffling for you.",
                    "You requested to overfit but enabled val dataloader shuffling. We are turning off the val "
                    "dataloader shuffling for you."]


def test_overfit_warnings_as_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as TheirModel

    _, ours = _fit(Trainer, _model(BoringModel, InOrder))
    _, theirs = _fit(pl.Trainer, _model(TheirModel, InOrder))
    assert ours == theirs
