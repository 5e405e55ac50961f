"""The Trainer's arguments as Lightning's own Trainer tests expect them (issue 41): the info line
for a limit of exactly 1 or 1.0, a limit of 0 switching a stage off, Lightning's refusals of
max_epochs/max_steps and of a model that is no TrainModule, log_every_n_steps' default, and the
min_epochs line on the Trainer's logger. Compared with pytorch_lightning where it helps."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Callback, Trainer, TrainModule
from zerotrain.trainer.errors import MisconfigurationException

pytestmark = pytest.mark.timeout(120)

LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
          "overfit_batches", "val_check_interval")


@pytest.fixture
def lightning_env(monkeypatch):
    """pytorch_lightning sets these; they are put back after the test."""
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def _trainer(tmp_path, **kw) -> Trainer:
    kw.setdefault("max_epochs", 1)
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=str(tmp_path), **kw)


def _data(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.steps = {"train": 0, "val": 0}

    def training_step(self, batch, batch_idx):
        self.steps["train"] += 1
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.steps["val"] += 1
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _info_lines(caplog, make) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        make()
    return [r.getMessage() for r in caplog.records if "was configured so" in r.getMessage()]


@pytest.mark.parametrize("name", LIMITS)
@pytest.mark.parametrize("value", [1, 1.0])
def test_a_limit_of_one_is_said_as_lightning(caplog, lightning_env, name, value):
    mine = _info_lines(caplog, lambda: Trainer(logger=False, **{name: value}))
    assert len(mine) == 1 and mine[0].startswith(f"`Trainer({name}={value})` was configured so ")
    assert not _info_lines(caplog, lambda: Trainer(logger=False))  # not said when not set
    pl = pytest.importorskip("pytorch_lightning")
    theirs = _info_lines(caplog, lambda: pl.Trainer(logger=False, **{name: value}))
    assert [line.rstrip(".") for line in mine] == [line.rstrip(".") for line in theirs]


def test_limit_train_batches_zero_trains_nothing(tmp_path):
    """Lightning skips the fit loop: no training step and no training hooks; the sanity check runs."""
    seen = []

    class Hooks(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append("on_train_start")

        def on_sanity_check_start(self, trainer, pl_module):
            seen.append("on_sanity_check_start")

    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(tmp_path, max_epochs=2, limit_train_batches=0.0, callbacks=[Hooks()])
    trainer.fit(model, _data(), _data())
    assert model.steps["train"] == 0 and trainer.global_step == 0 and trainer.current_epoch == 0
    assert seen == ["on_sanity_check_start"] and model.steps["val"] == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_limit_val_batches_zero_point_zero_validates_nothing(tmp_path):
    model = Net()
    trainer = _trainer(tmp_path, max_epochs=2, limit_val_batches=0.0)
    trainer.fit(model, _data(), _data())
    assert model.steps == {"train": 8, "val": 0} and trainer.current_epoch == 2


@pytest.mark.parametrize(("kw", "name"), [({"max_epochs": -100}, "max_epochs"), ({"max_steps": -2}, "max_steps"),
                                          ({"max_epochs": 1.5}, "max_epochs")])
def test_max_epochs_and_max_steps_refused_in_lightnings_words(kw, name):
    with pytest.raises(MisconfigurationException, match=f"`{name}` must be a non-negative integer or -1") as e:
        Trainer(logger=False, **kw)
    assert isinstance(e.value, ValueError) and f"{name}={kw[name]!r}" in str(e.value)


@pytest.mark.parametrize("method", ["fit", "validate", "test", "predict"])
def test_a_model_that_is_no_train_module_is_a_type_error(method):
    with pytest.raises(TypeError, match=f"Trainer.{method}: `model` must be a `TrainModule`, got `Linear`"):
        getattr(Trainer(logger=False, enable_checkpointing=False), method)(torch.nn.Linear(2, 2))


def test_log_every_n_steps_default_is_lightnings(lightning_env):
    assert Trainer(logger=False).log_every_n_steps == 50
    pl = pytest.importorskip("pytorch_lightning")
    assert pl.Trainer(logger=False).log_every_n_steps == 50


def test_min_epochs_line_comes_from_the_trainers_logger(tmp_path, caplog):
    """Lightning's tests capture the 'min_epochs not met' line on the Trainer module's logger."""

    class StopAtOnce(Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = True

    model = Net()
    with caplog.at_level(logging.INFO, logger="zerotrain.trainer.trainer"):
        _trainer(tmp_path, max_epochs=5, min_epochs=3, callbacks=[StopAtOnce()]).fit(model, _data())
    lines = [r.getMessage() for r in caplog.records if "has not been met" in r.getMessage()]
    assert lines == ["Trainer was signaled to stop but the required `min_epochs=3` or `min_steps=None` has not been "
                     "met. Training will continue..."]
    assert model.steps["train"] == 3 * 4  # three whole epochs; the stop held back ends the run then


def _validations(lib, tmp_path, **kw) -> tuple[list, int]:
    """The global steps at which ``lib``'s fit validated (sanity check left out), and its steps."""

    class M(lib.LightningModule if hasattr(lib, "LightningModule") else TrainModule):
        def __init__(self):
            super().__init__()
            self.layer, self.at = torch.nn.Linear(3, 1), []

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("v", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def on_validation_epoch_start(self):
            if not self.trainer.sanity_checking:
                self.at.append((self.trainer.current_epoch, self.trainer.global_step))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    m = M()
    t = lib.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), **kw)
    t.fit(m, _data(40), _data(8))
    return m.at, t.global_step


@pytest.mark.parametrize("kw", [
    {"max_steps": 3},  # stopped mid-epoch by max_steps: no validation at the end of fit
    {"max_epochs": 2, "val_check_interval": 1 / 3},  # int(10 / 3) = 3 batches: 3 per epoch, none at fit's end
    {"max_epochs": 2, "val_check_interval": 4},  # every 4 batches of each epoch (4, 8), not of the run
    {"max_epochs": 2, "val_check_interval": 4, "check_val_every_n_epoch": None},  # of the run: 4, 8, 12, 16, 20
    {"max_epochs": 2, "val_check_interval": 0.5, "accumulate_grad_batches": 3},  # batches, not optimizer steps
    {"max_epochs": 4, "check_val_every_n_epoch": 2},
])
def test_validation_placed_as_lightning(tmp_path, lightning_env, kw):
    mine = _validations(__import__("zerotrain"), tmp_path, **kw)
    pl = pytest.importorskip("pytorch_lightning")
    assert mine == _validations(pl, tmp_path, **kw)


def test_val_check_interval_longer_than_the_epoch_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"must be less than or equal to the number of the training batches \(10\)"):
        _trainer(tmp_path, val_check_interval=11).fit(Net(), _data(40), _data(8))
    _trainer(tmp_path, max_epochs=2, val_check_interval=11, check_val_every_n_epoch=None).fit(Net(), _data(40), _data(8))


def test_a_fraction_interval_without_epochs_is_refused():
    """With check_val_every_n_epoch=None validation counts the run's batches: a fraction of an epoch is refused."""
    with pytest.raises(MisconfigurationException, match="should be an integer or a time-based duration"):
        Trainer(logger=False, val_check_interval=0.5, check_val_every_n_epoch=None)
    Trainer(logger=False, val_check_interval=5, check_val_every_n_epoch=None)


def test_fast_dev_run_keeps_a_dummy_logger(tmp_path):
    """Lightning replaces the loggers by one DummyLogger under fast_dev_run (none when logging was off):
    a step that writes to ``self.logger.experiment`` runs, and nothing is written."""
    from zerotrain.loggers.logger import DummyLogger

    class M(Net):
        def training_step(self, batch, batch_idx):
            self.logger.experiment.add_histogram("w", self.layer.weight, batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=str(tmp_path), fast_dev_run=2,
                      enable_progress_bar=False, enable_model_summary=False)
    assert len(trainer.loggers) == 1 and isinstance(trainer.logger, DummyLogger)
    trainer.fit(M(), _data())
    assert trainer.global_step == 2 and not list(tmp_path.iterdir())
    assert Trainer(fast_dev_run=True, logger=False).loggers == []


def test_barebones_attributes_as_lightning():
    """Lightning's Trainer holds a PassThroughProfiler when no profiler is given; its barebones
    test reads ``_detect_anomaly``."""
    from zerotrain.profilers import PassThroughProfiler

    trainer = Trainer(barebones=True)
    assert isinstance(trainer.profiler, PassThroughProfiler) and trainer._detect_anomaly is False
    assert Trainer(logger=False, detect_anomaly=True)._detect_anomaly is True


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_an_evaluation_without_any_model_is_a_type_error(fn):
    with pytest.raises(TypeError, match=rf"`Trainer.{fn}\(\)` requires a `TrainModule`"):
        getattr(Trainer(logger=False, enable_checkpointing=False), fn)()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_datamodule_sees_the_exception(tmp_path, error):
    from zerotrain import DataModule

    seen = []

    class Data(DataModule):
        def train_dataloader(self):
            return _data()

        def on_exception(self, exception):
            seen.append(exception)

    class Failing(Net):
        def on_fit_start(self):
            raise error("boom")

    with pytest.raises((RuntimeError, SystemExit)):
        _trainer(tmp_path).fit(Failing(), datamodule=Data())
    assert len(seen) == 1 and isinstance(seen[0], error)
