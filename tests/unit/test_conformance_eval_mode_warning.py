"""Training that starts with submodules in eval mode warns, as Lightning's fit loop does before
``on_train_start`` (issue 41; loops/test_training_loop.py::test_eval_mode_warning); the modes are
left as the user set them."""
from __future__ import annotations

import warnings

import pytest
import torch

from zerotrain import Trainer
from zerotrain.demos import BoringModel
from zerotrain.utilities.warnings import PossibleUserWarning

pytestmark = pytest.mark.timeout(120)


def _fit(model, tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=0,
                      logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(model)
    return [w for w in seen if issubclass(w.category, PossibleUserWarning) and "eval mode" in str(w.message)]


def test_a_submodule_in_eval_mode_warns_once_and_keeps_its_mode(tmp_path):
    model = BoringModel()
    model.frozen = torch.nn.Linear(32, 16).eval()
    seen = _fit(model, tmp_path)
    assert [str(w.message) for w in seen] == [
        "Found 1 module(s) in eval mode at the start of training. This may lead to unexpected behavior during "
        "training. If this is intentional, you can ignore this warning."]
    assert not model.frozen.training


def test_all_in_train_mode_says_nothing(tmp_path):
    assert _fit(BoringModel(), tmp_path) == []
