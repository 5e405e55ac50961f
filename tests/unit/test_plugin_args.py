"""``Trainer(callbacks=, logger=)`` checked when built (issue 40): a value that is no callback or
logger is a TypeError naming the argument, the value and what is expected (it failed at the first
hook or log call, after set-up; pytorch_lightning 2.6 takes ``callbacks=[1]`` and ``logger='x'``
without a word). Duck-typed callbacks and loggers, as Lightning's, still work."""
from __future__ import annotations

import pytest
import torch

from toy import ToyModule
from zerotrain import Trainer
from zerotrain.callbacks import ModelCheckpoint

QUIET = dict(devices=1, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)


@pytest.mark.parametrize("kwargs,said", [
    (dict(callbacks=[1]), "Trainer: callbacks[0]=1 is a int; expected a Callback"),
    (dict(callbacks=1), "Trainer: callbacks=1; expected None, a Callback"),
    (dict(callbacks="abc"), "Trainer: callbacks='abc'; expected None"),
    (dict(callbacks=[ModelCheckpoint]), "callbacks[0]=<class"),
    (dict(logger="x"), "Trainer: logger='x' is not a logger; expected True, False, None, a Logger (zerotrain's "
                       "or pytorch_lightning's, or an object with log_metrics, log_hyperparams, save, finalize"),
    (dict(logger=[False]), "Trainer: logger[0]=False is not a logger"),
    (dict(logger=3), "Trainer: logger=3 is not a logger"),
])
def test_a_value_that_is_no_callback_or_logger_is_a_type_error_when_built(tmp_path, kwargs, said):
    with pytest.raises(TypeError) as info:
        Trainer(default_root_dir=str(tmp_path), **QUIET, **kwargs)
    assert said in str(info.value), str(info.value)
    if kwargs.get("callbacks") == [ModelCheckpoint]:
        assert "the class ModelCheckpoint, not an instance of it" in str(info.value)


class PlainHooks:
    """A callback by duck typing: no base class, one hook, no state."""

    def __init__(self):
        self.ended = 0

    def on_train_end(self, trainer, module):
        self.ended += 1


class PlainLogger:
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs): ...

    def save(self): ...

    def finalize(self, status="success"):
        self.status = status


def test_duck_typed_callbacks_and_loggers_are_welcome(tmp_path, monkeypatch):
    plain, logger = PlainHooks(), PlainLogger()
    callbacks = [plain]
    # importing Lightning sets this variable: let monkeypatch own it
    pl = pytest.importorskip("pytorch_lightning")

    class Counting(pl.Callback):  # a real Lightning callback instance
        def __init__(self):
            self.batches = 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.batches += 1

    counting = Counting()
    callbacks.append(counting)
    torch.manual_seed(0)
    trainer = Trainer(default_root_dir=str(tmp_path), max_steps=3, logger=logger, log_every_n_steps=1,
                      callbacks=callbacks, **QUIET)
    trainer.fit(ToyModule())
    assert plain.ended == 1 and counting.batches == 3
    assert logger.rows and logger.status == "success", "the duck-typed logger was not used"
    assert set(trainer.hooks.state_dict()) >= {counting.state_key}  # a hook-only object has no state
