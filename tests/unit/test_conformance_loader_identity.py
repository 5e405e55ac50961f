"""The Trainer's loaders and data arguments as Lightning's trainer/test_dataloaders.py expects
(issue 41): on one process an in-order loader is used as given (``trainer.train_dataloader`` is
the user's object), ``fast_dev_run=1`` reads back as True, a whole float limit above 1 is that
count, an iterable loader that yields nothing makes an empty epoch (no error), and fast_dev_run
does not warn about the logging interval."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel, RandomDataset


def _trainer(tmp_path, **kw):
    opts = dict(default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)
    opts.update(kw)
    return Trainer(**opts)


def test_an_in_order_loader_is_used_as_given_on_one_process(tmp_path):
    train, val = DataLoader(RandomDataset(32, 8)), DataLoader(RandomDataset(32, 8))
    trainer = _trainer(tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    trainer.fit(BoringModel(), train, val)
    assert trainer.train_dataloader is train and trainer.val_dataloaders is val
    trainer.test(trainer.lightning_module, dataloaders=val, verbose=False)
    assert trainer.test_dataloaders is val


def test_fast_dev_run_one_is_true_and_does_not_warn_about_logging(tmp_path):
    trainer = Trainer(default_root_dir=str(tmp_path), fast_dev_run=1, log_every_n_steps=2,
                      enable_progress_bar=False, enable_model_summary=False)
    assert trainer.fast_dev_run is True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*smaller than the logging interval")
        trainer.fit(BoringModel())


def test_a_whole_float_limit_above_one_is_a_count():
    trainer = Trainer(limit_test_batches=1e50, limit_val_batches=2.0, logger=False)
    assert trainer.limit_test_batches == int(1e50) and isinstance(trainer.limit_test_batches, int)
    assert trainer.limit_val_batches == 2 and isinstance(trainer.limit_val_batches, int)


@pytest.mark.parametrize("yield_at_all", [False, True])
def test_an_iterable_loader_without_batches_makes_an_empty_epoch(tmp_path, yield_at_all):
    class Data(IterableDataset):
        def __init__(self, model):
            self.model = model

        def __iter__(self):
            if yield_at_all and self.model.current_epoch == 0:
                yield from (torch.rand(32) for _ in range(3))

    model = BoringModel()
    trainer = _trainer(tmp_path, max_epochs=2)
    trainer.fit(model, DataLoader(Data(model), batch_size=2))
    assert (trainer.global_step, trainer.current_epoch) == (2 * yield_at_all, 2)
