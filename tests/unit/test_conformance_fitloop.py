"""Issue 41: the fit loop seen from outside (``trainer/loop/progress.py``): ``trainer.fit_loop`` and
the evaluation loops' progress counters, ``val_check_batch``, ``enable_validation``, an epoch cut
by ``on_train_batch_start`` returning -1, ``check_val_every_n_epoch`` in the progress bar. Where a
run is compared, pytorch-lightning 2.6 runs the same module in the same test (skipped when it is
missing)."""
from __future__ import annotations

import logging
import pickle
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(120)


def _pl():
    return pytest.importorskip("pytorch_lightning")


def _module(base, cut_at=None, scheduler=False):
    """A small module; ``on_train_batch_start`` returns -1 at batch ``cut_at``; ``scheduler``: a
    per-epoch StepLR (gamma 0.1)."""

    class Small(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("v", self.net(batch[0]).pow(2).mean())

        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == cut_at else None

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return ([opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.1)]) if scheduler else opt

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)

    return Small()


_QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _counters(trainer):
    fl = trainer.fit_loop
    el = fl.epoch_loop
    return {
        "epoch": (fl.epoch_progress.current.completed, fl.epoch_progress.current.processed, trainer.current_epoch),
        "batches": (el.batch_progress.current.ready, el.batch_progress.current.completed,
                    el.batch_progress.total.ready, el.batch_progress.total.completed),
        "idx": (fl.batch_idx, fl.total_batch_idx),
        "steps": (el.global_step, el._batches_that_stepped, trainer.global_step),
        "val": (el.val_loop.batch_progress.current.completed, el.val_loop.batch_progress.total.completed),
        "done": fl.done,
        "val_check_batch": trainer.val_check_batch,
        "enable_validation": trainer.enable_validation,
    }


@pytest.mark.parametrize("kwargs", [dict(max_epochs=2, val_check_interval=0.5, limit_val_batches=2),
                                    dict(max_epochs=3, val_check_interval=2, accumulate_grad_batches=2)])
def test_fit_loop_counters_after_fit_as_lightning(tmp_path, kwargs):
    pl = _pl()
    trainer = Trainer(default_root_dir=str(tmp_path / "zt"), num_sanity_val_steps=1, **_QUIET, **kwargs)
    trainer.fit(_module(TrainModule))
    ours = _counters(trainer)
    ref_trainer = pl.Trainer(default_root_dir=str(tmp_path / "pl"), num_sanity_val_steps=1, accelerator="cpu",
                             **_QUIET, **kwargs)
    ref_trainer.fit(_module(pl.LightningModule))
    assert ours == _counters(ref_trainer)


def test_fit_loop_fields_set_the_trainers_counters():
    """As Lightning's tests fake a position in the run: setting a progress count sets the Trainer's."""
    trainer = Trainer(max_epochs=5, min_epochs=2, **_QUIET)
    fl = trainer.fit_loop
    fl.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 7
    fl.epoch_progress.current.completed = 3
    assert (trainer.global_step, trainer.current_epoch) == (7, 3)
    fl.max_epochs = 3
    assert trainer.max_epochs == 3 and fl.done  # 3 epochs processed
    fl.max_epochs, fl.epoch_progress.current.processed = 5, 1
    trainer.should_stop = True
    assert not fl._can_stop_early and not fl.done  # min_epochs=2 not met
    fl.epoch_progress.current.processed = 2
    assert fl._can_stop_early and fl.done
    fl.epoch_loop.max_steps = 7
    assert trainer.max_steps == 7
    with pytest.raises(AttributeError, match="no progress count"):
        fl.epoch_progress.current.finished = 1
    copy = pickle.loads(pickle.dumps(trainer.fit_loop))  # a Trainer that pickles keeps pickling (Lightning's tests)
    assert (copy.epoch_loop.global_step, copy.epoch_progress.current.completed) == (7, trainer.current_epoch)


@pytest.mark.parametrize(("max_epochs", "max_steps", "done"), [(-1, -1, False), (5, -1, False), (0, -1, True),
                                                                (-1, 0, True), (None, 0, True)])
def test_fit_loop_done_before_fit(max_epochs, max_steps, done, caplog):
    trainer = Trainer(max_epochs=max_epochs, max_steps=max_steps, **_QUIET)
    with caplog.at_level(logging.INFO, logger="zerotrain.utilities.rank_zero"):
        assert trainer.fit_loop.done is done
    assert ("`Trainer.fit` stopped" in caplog.text) is done


def test_fit_loop_max_epochs_set_between_fits(tmp_path):
    epochs = []

    class Recording(type(_module(TrainModule))):
        def on_train_epoch_end(self):
            epochs.append(self.current_epoch)

    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=2, limit_train_batches=1, limit_val_batches=1, **_QUIET)
    model = Recording()
    trainer.fit(model)
    trainer.fit_loop.max_epochs = 4
    trainer.fit(model)
    assert epochs == [0, 1, 2, 3]


def test_every_evaluation_batch_runs_through_its_loop_view(tmp_path):
    """``_evaluation_step`` of ``fit_loop.epoch_loop.val_loop`` (sanity check and validation in fit)
    and of ``test_loop`` runs once per batch: Lightning's tests count the calls with a wrapping mock."""
    class WithTest(type(_module(TrainModule))):
        def test_step(self, batch, batch_idx):
            self.log("t", self.net(batch[0]).sum())

    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=1, limit_val_batches=2, num_sanity_val_steps=1,
                      **_QUIET)
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    model = WithTest()
    with mock.patch.object(val_loop, "_evaluation_step", wraps=val_loop._evaluation_step) as mocked:
        trainer.fit(model)
    assert mocked.call_count == 1 + 2
    assert val_loop.batch_progress.total.completed == 2  # the sanity check's batch is not counted

    with mock.patch.object(trainer.test_loop, "_evaluation_step", wraps=trainer.test_loop._evaluation_step) as mocked:
        trainer.test(model, dataloaders=DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2), verbose=False)
    assert mocked.call_count == 3 and trainer.test_loop.batch_progress.current.completed == 3


def test_plateau_scheduler_metric_comes_from_get_monitor_value(tmp_path):
    class Plateau(type(_module(TrainModule))):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                                                       "monitor": "v"}}

    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=2, limit_val_batches=1, **_QUIET)
    epoch_loop = trainer.fit_loop.epoch_loop
    with mock.patch.object(epoch_loop, "_get_monitor_value", wraps=epoch_loop._get_monitor_value) as mocked:
        trainer.fit(Plateau())
    assert [c.args for c in mocked.call_args_list] == [("v",), ("v",)]


@pytest.mark.parametrize("cut_at", [1, 9])
def test_minus_one_from_on_train_batch_start_ends_the_epoch_as_lightning(tmp_path, cut_at):
    """The epoch ends with that batch: ``is_last_batch``, ``fit_loop.batch_idx`` is its index, and the
    epoch's scheduler still steps (lr 0.1 * 0.1 ** epochs)."""
    pl = _pl()
    result = []
    for lib, base, extra in ((Trainer, TrainModule, {}), (pl.Trainer, pl.LightningModule, {"accelerator": "cpu"})):
        trainer = lib(default_root_dir=str(tmp_path / base.__name__), max_epochs=2, limit_val_batches=0, **_QUIET,
                      **extra)
        trainer.fit(_module(base, cut_at=cut_at, scheduler=True))
        result.append((trainer.fit_loop.batch_idx, trainer.global_step, trainer.is_last_batch,
                       round(trainer.optimizers[0].param_groups[0]["lr"], 12)))
    assert result[0] == result[1]
    assert result[0][3] == round(0.1 * 0.1 ** 2, 12)


def test_check_val_every_n_epoch_progress_bar_total_is_zero_in_epochs_without_validation(tmp_path, monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no tqdm monitor thread
    seen = []

    class Recording(type(_module(TrainModule))):
        def on_train_epoch_end(self):
            seen.append(self.trainer.progress_bar_callback.total_val_batches)

    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=4, limit_val_batches=2, check_val_every_n_epoch=2,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False)
    trainer.fit(Recording())
    assert seen == [0, 2, 0, 2]


@pytest.mark.parametrize("limit_val_batches", [0, 0.0])
def test_val_check_interval_longer_than_the_epoch_is_fine_without_validation(tmp_path, limit_val_batches):
    trainer = Trainer(default_root_dir=str(tmp_path), max_epochs=1, limit_train_batches=3, val_check_interval=10,
                      limit_val_batches=limit_val_batches, **_QUIET)
    trainer.fit(_module(TrainModule))
    assert trainer.global_step == 3 and trainer.val_check_batch == 10


def test_check_val_every_n_epoch_float_refused_in_lightnings_words():
    from zerotrain.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="`check_val_every_n_epoch` should be an integer, found 1.2"):
        Trainer(check_val_every_n_epoch=1.2, **_QUIET)
