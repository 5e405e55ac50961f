"""Lightning's configuration checks before a stage (trainer/test_config_validator.py, issue 41):
its messages for a missing ``training_step``/``configure_optimizers``/evaluation step, its
warnings for a validation step without data and data without a step, and every refusal raised
before the stage sets anything up (no log directory made, the Trainer still free for a model)."""
from __future__ import annotations

import os

import pytest

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel
from zerotrain.trainer.errors import MisconfigurationException


def _trainer(tmp_path, **kw):
    return Trainer(default_root_dir=str(tmp_path), max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                   enable_progress_bar=False, enable_model_summary=False, **kw)


@pytest.mark.parametrize("hook", ["training_step", "configure_optimizers"])
def test_fit_without_a_required_hook(tmp_path, hook):
    model = BoringModel()
    setattr(model, hook, None)
    with pytest.raises(MisconfigurationException, match=rf"No `{hook}\(\)` method defined."):
        _trainer(tmp_path).fit(model)


@pytest.mark.parametrize(("attr", "said"), [("validation_step", "You passed in a `val_dataloader` but have no"),
                                            ("val_dataloader", "You defined a `validation_step` but have no")])
def test_validation_half_defined_warns(tmp_path, attr, said):
    model = BoringModel()
    setattr(model, attr, None)
    with pytest.warns(UserWarning, match=said):
        _trainer(tmp_path, logger=False, enable_checkpointing=False).fit(model)


def test_an_evaluation_refused_before_set_up_leaves_the_trainer_free(tmp_path):
    trainer = _trainer(tmp_path)
    model = BoringModel()
    model.validation_step = None
    with pytest.raises(MisconfigurationException, match=r"No `validation_step\(\)` method defined"):
        trainer.validate(model)
    model = BoringModel()
    model.predict_step = None
    with pytest.raises(MisconfigurationException, match="`predict_step` cannot be None"):
        trainer.predict(model)
    model = BoringModel()
    model.test_step = None
    with pytest.raises(MisconfigurationException, match=r"No `test_step\(\)` method defined"):
        trainer.test(model)  # a third model: none of the refused ones was set up


def test_manual_optimization_refusals_come_before_any_directory(tmp_path):
    model = BoringModel()
    model.automatic_optimization = False
    with pytest.raises(MisconfigurationException, match="Automatic gradient clipping is not supported"):
        _trainer(tmp_path, gradient_clip_val=1.0).fit(model)
    with pytest.raises(MisconfigurationException, match="Automatic gradient accumulation is not supported"):
        _trainer(tmp_path, accumulate_grad_batches=2).fit(model)
    assert os.listdir(tmp_path) == []
