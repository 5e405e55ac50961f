"""``trainer._data_connector`` (issue 41): Lightning's public tests give a Trainer its model and
data without running a stage (``attach_data``/``attach_dataloaders``/``attach_datamodule``), then
read ``estimated_stepping_batches`` or run ``prepare_data`` under mocked ranks
(trainer/properties/test_estimated_stepping_batches.py, core/test_datamodules.py); and
``lightning.pytorch.trainer.trainer`` renamed is ``zerotrain.trainer.trainer`` (the Trainer's module
before trainer/ was split into rooms; test_val_check_interval.py imports the Trainer from it)."""
from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import zerotrain
from zerotrain import DataModule, Trainer
from zerotrain.demos import BoringModel

pytestmark = pytest.mark.timeout(60)


def _trainer(**kw):
    return Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, **kw)


def test_the_trainers_lightning_module_path():
    module = importlib.import_module("zerotrain.trainer.trainer")
    assert module.Trainer is zerotrain.Trainer
    with mock.patch("zerotrain.trainer.trainer.Trainer.local_rank", new_callable=mock.PropertyMock) as rank:
        rank.return_value = 3
        assert _trainer().local_rank == 3


@pytest.mark.parametrize("max_epochs, accumulate, expected", [(2, 1, 128), (1, 2, 32), (1, 3, 22)])
def test_attached_module_data_gives_the_stepping_batches(max_epochs, accumulate, expected):
    trainer = _trainer(max_epochs=max_epochs, accumulate_grad_batches=accumulate)
    model = BoringModel()  # 64 training batches
    trainer._data_connector.attach_data(model)
    assert trainer.lightning_module is model and model.trainer is trainer
    assert trainer.estimated_stepping_batches == expected


class _Endless(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.randn(32)


def test_attached_loaders_win_over_the_modules():
    trainer = _trainer(max_epochs=1)
    model = BoringModel()
    trainer._data_connector.attach_data(model, train_dataloaders=DataLoader(torch.randn(10, 32), batch_size=5))
    assert trainer.estimated_stepping_batches == 2
    trainer = _trainer(max_steps=7)
    trainer._data_connector.attach_data(BoringModel(), train_dataloaders=DataLoader(_Endless()))
    assert trainer.estimated_stepping_batches == 7


def test_a_datamodule_attached_after_the_loaders_keeps_them():
    class Data(DataModule):
        def train_dataloader(self):
            return DataLoader(torch.randn(12, 32), batch_size=4)

    trainer, model, dm = _trainer(max_epochs=1), BoringModel(), Data()
    trainer._data_connector.attach_datamodule(model, datamodule=dm)
    assert trainer.datamodule is dm and dm.trainer is trainer
    assert trainer.estimated_stepping_batches == 3  # the datamodule's loader, not the module's 64
    trainer = _trainer(max_epochs=1)
    trainer._data_connector.attach_data(model, train_dataloaders=DataLoader(torch.randn(10, 32), batch_size=5),
                                        datamodule=dm)
    assert trainer.estimated_stepping_batches == 2


@pytest.mark.parametrize("per_node, local, node, runs", [(True, 0, 0, True), (True, 0, 1, True), (True, 1, 0, False),
                                                         (False, 0, 0, True), (False, 0, 1, False),
                                                         (False, 1, 0, False)])
def test_prepare_data_runs_where_lightning_runs_it(per_node, local, node, runs):
    class Data(DataModule):
        def prepare_data(self):
            calls.append("dm")

    class Model(BoringModel):
        def prepare_data(self):
            calls.append("model")

    calls = []
    dm = Data()
    dm.prepare_data_per_node = per_node
    model = Model()
    model.prepare_data_per_node = per_node
    trainer = _trainer()
    trainer._data_connector.attach_data(model, datamodule=dm)
    with mock.patch.object(Trainer, "local_rank", new_callable=mock.PropertyMock, return_value=local), \
            mock.patch.object(Trainer, "node_rank", new_callable=mock.PropertyMock, return_value=node):
        trainer._data_connector.prepare_data()
    assert calls == (["dm", "model"] if runs else [])


@pytest.mark.parametrize("overfit, expected", [(4, 4), (0.25, 16), (0, 64)])
def test_fit_loop_setup_data_counts_the_epochs_batches(overfit, expected):
    trainer = _trainer(overfit_batches=overfit)
    trainer._data_connector.attach_data(BoringModel())  # 64 training batches
    trainer.fit_loop.setup_data()
    assert trainer.num_training_batches == expected


def test_fit_loop_setup_data_loads_nothing_with_limit_train_batches_zero():
    trainer = _trainer(limit_train_batches=0)
    trainer._data_connector.attach_data(BoringModel())
    trainer.fit_loop.setup_data()
    assert trainer.train_dataloader is None and trainer.num_training_batches == 0
    trainer.limit_train_batches = 1
    trainer.fit_loop.setup_data()
    assert trainer.train_dataloader is not None and trainer.num_training_batches == 1
