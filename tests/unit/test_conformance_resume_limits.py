"""Resuming past ``max_epochs`` and the fit loop's log lines, as Lightning's (issue 41;
callbacks/test_early_stopping.py::test_resume_early_stopping_from_checkpoint and
trainer/test_trainer.py::test_trainer_min_steps_and_min_epochs_not_reached)."""
from __future__ import annotations

import logging

import pytest

from zerotrain import Trainer
from zerotrain.callbacks import EarlyStopping
from zerotrain.demos import BoringModel
from zerotrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.timeout(120)


def _trainer(tmp_path, **kw):
    return Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, limit_train_batches=1, limit_val_batches=0, **kw)


def test_a_fit_resumed_past_max_epochs_is_refused_in_lightnings_words(tmp_path):
    trainer = _trainer(tmp_path, max_epochs=3)
    trainer.fit(BoringModel())
    path = str(tmp_path / "three.ckpt")
    trainer.save_checkpoint(path)
    with pytest.raises(MisconfigurationException, match=r"You restored a checkpoint with current_epoch=3, but you "
                                                        r"have set Trainer\(max_epochs=1\)\."):
        _trainer(tmp_path, max_epochs=1).fit(BoringModel(), ckpt_path=path)
    again = _trainer(tmp_path, max_epochs=3)  # at max_epochs: nothing left to train, no error
    again.fit(BoringModel(), ckpt_path=path)
    assert again.current_epoch == 3


def test_the_fit_loops_lines_come_from_lightnings_trainer_logger_renamed(tmp_path, caplog):
    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"] * 0.0)
            return out

    trainer = _trainer(tmp_path, min_epochs=3, callbacks=[EarlyStopping(monitor="loss", patience=0,
                                                                       check_on_train_epoch_end=True)])
    with caplog.at_level(logging.INFO, logger="zerotrain.trainer.trainer"):
        trainer.fit(Model())
    lines = [r for r in caplog.records if "has not been met. Training will continue" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "zerotrain.trainer.trainer"
