"""``trainer.val_dataloaders`` / ``test_dataloaders`` / ``predict_dataloaders`` are the loaders of
the stage that ran last, as Lightning's (issue 41; trainer/test_dataloaders.py::
test_dataloaders_reset_and_attach): a ``validate(dataloaders=...)`` after a ``fit`` replaced
nothing, so ``val_dataloaders`` still named fit's loader."""
from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from zerotrain import Trainer
from zerotrain.demos import BoringModel, RandomDataset

pytestmark = pytest.mark.timeout(120)


def test_each_stage_attaches_its_own_loaders(tmp_path):
    loaders = [DataLoader(RandomDataset(32, 8)) for _ in range(4)]
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=1, limit_test_batches=1,
                      limit_predict_batches=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False)
    model = BoringModel()
    trainer.fit(model, train_dataloaders=loaders[0], val_dataloaders=loaders[1])
    assert trainer.val_dataloaders.dataset is loaders[1].dataset
    trainer.validate(model, dataloaders=loaders[2])
    assert trainer.val_dataloaders.dataset is loaders[2].dataset
    trainer.test(model, dataloaders=loaders[3])
    assert trainer.test_dataloaders.dataset is loaders[3].dataset


def test_a_stage_limited_to_zero_attaches_none(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, limit_test_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.test(BoringModel())
    assert trainer.test_dataloaders is None
