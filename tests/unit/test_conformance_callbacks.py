"""Issue 41: callbacks behave as Lightning's where Lightning's own tests look (the order of the
monitoring callbacks, EarlyStopping's overridable pieces and messages). Where a run is compared,
pytorch-lightning 2.6 runs the same module in the same test (skipped when it is missing)."""
from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import EarlyStopping, LearningRateMonitor
from zerotrain.loggers import CSVLogger
from zerotrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.timeout(120)


def _module(base, epoch_values):
    """A module that logs ``m`` = ``epoch_values[epoch]`` in its own ``on_train_epoch_end``."""

    class EpochEndLogger(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def on_train_epoch_end(self):
            self.log("m", float(epoch_values[self.current_epoch]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

    return EpochEndLogger()


_QUIET = dict(max_epochs=10, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)


def test_early_stopping_sees_what_the_modules_on_train_epoch_end_logged(tmp_path):
    """Lightning calls the monitoring callbacks' ``on_train_epoch_end`` after the module's, so a
    metric the module logs there is checked in the same epoch (before: RuntimeError, never logged)."""
    values = [6, 5, 5, 5, 5, 5, 5, 5, 5, 5]
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[EarlyStopping("m", patience=3)], **_QUIET)
    trainer.fit(_module(TrainModule, values))
    pl = pytest.importorskip("pytorch_lightning")
    theirs = pl.Trainer(default_root_dir=tmp_path, callbacks=[pl.callbacks.EarlyStopping("m", patience=3)],
                        accelerator="cpu", **_QUIET)
    theirs.fit(_module(pl.LightningModule, values))
    assert (trainer.current_epoch, trainer.global_step) == (theirs.current_epoch, theirs.global_step) == (5, 10)


def test_early_stopping_decides_through_evaluate_stopping_criteria(tmp_path):
    """Lightning's tests (and users) replace ``_evaluate_stopping_criteria``: its answer decides."""
    cb = EarlyStopping("m")
    with mock.patch.object(cb, "_evaluate_stopping_criteria", side_effect=[(False, "a"), (True, "b")]) as decide:
        trainer = Trainer(default_root_dir=tmp_path, callbacks=[cb], **_QUIET)
        trainer.fit(_module(TrainModule, range(10)))
    assert decide.call_count == 2 and trainer.current_epoch == 2
    assert cb.stopping_reason_message == "b"


def test_early_stopping_squeezes_the_metric_and_skips_fast_dev_run():
    cb = EarlyStopping("m")
    trainer = type("T", (), {"callback_metrics": {"m": torch.tensor([[[0.5]]])}, "fast_dev_run": False,
                             "should_stop": False, "current_epoch": 0,
                             "strategy": type("S", (), {"any_rank": staticmethod(bool)})()})()
    with mock.patch.object(cb, "_evaluate_stopping_criteria", return_value=(False, "")) as decide:
        cb._run_early_stopping_check(trainer)
        trainer.fast_dev_run = 1
        cb._run_early_stopping_check(trainer)
    decide.assert_called_once()
    assert decide.call_args.args[0].shape == ()


@pytest.mark.parametrize(("rank_zero_only", "world_size", "rank", "line"), [
    (False, 1, 0, "bar"), (False, 2, 1, "[rank: 1] bar"), (True, 2, 0, "[rank: 0] bar"), (True, 2, 1, None)])
def test_early_stopping_log_info_prefixes_the_rank(rank_zero_only, world_size, rank, line):
    with mock.patch("zerotrain.callbacks.early_stopping.log.info") as info:
        EarlyStopping._log_info(mock.Mock(global_rank=rank, world_size=world_size), "bar", rank_zero_only)
    assert info.call_args_list == ([mock.call(line)] if line else [])


def test_early_stopping_messages_are_lightnings():
    with pytest.raises(MisconfigurationException, match="`mode` can be min, max, got median"):
        EarlyStopping("m", mode="median")
    cb = EarlyStopping("m", stopping_threshold=0.6, divergence_threshold=8.0)
    assert cb.evaluate(0.5)[1].startswith("Stopping threshold reached: m = ")
    assert cb.evaluate(10.0)[1].startswith("Divergence threshold reached: m = ")
    cb = EarlyStopping("missing", strict=False, verbose=True)
    with pytest.warns(RuntimeWarning, match="metric `missing` which is not available"):
        cb._run_early_stopping_check(type("T", (), {"callback_metrics": {"x": 1.0}, "fast_dev_run": False})())


def test_early_stopping_not_checked_outside_fit(tmp_path, caplog):
    """Lightning checks only while fitting: ``validate`` never stops or raises for a missing metric."""
    cb = EarlyStopping("never_logged", check_on_train_epoch_end=False)

    class M(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def validation_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    with caplog.at_level(logging.WARNING):
        Trainer(default_root_dir=tmp_path, callbacks=[cb], **_QUIET).validate(M())
    assert cb.wait_count == 0


class _TwoGroups(TrainModule):
    def __init__(self, optimizer="SGD", names=(None, None)):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        self.optimizer, self.names = optimizer, names

    def training_step(self, batch, batch_idx):
        return (self.a(batch[0]) + self.b(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        groups = [{"params": m.parameters(), **({"name": n} if n else {})} for m, n in zip((self.a, self.b), self.names)]
        return getattr(torch.optim, self.optimizer)(groups, lr=0.1, weight_decay=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)


def _lr_fit(tmp_path, cb, module, **kw):
    Trainer(default_root_dir=tmp_path, callbacks=[cb], logger=CSVLogger(tmp_path), max_epochs=1,
            log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, **kw).fit(module)


def test_lr_monitor_keeps_the_last_momentum_and_weight_decay(tmp_path):
    """Lightning's ``last_momentum_values`` / ``last_weight_decay_values``: None until logged."""
    quiet = LearningRateMonitor()
    _lr_fit(tmp_path, quiet, _TwoGroups())
    assert quiet.last_momentum_values == {"lr-SGD/pg1-momentum": None, "lr-SGD/pg2-momentum": None}
    both = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    _lr_fit(tmp_path, both, _TwoGroups("Adam"))
    assert both.last_momentum_values == {"lr-Adam/pg1-momentum": 0.9, "lr-Adam/pg2-momentum": 0.9}
    assert both.last_weight_decay_values == {"lr-Adam/pg1-weight_decay": 0.01, "lr-Adam/pg2-weight_decay": 0.01}


def test_lr_monitor_warns_when_an_optimizer_has_no_momentum(tmp_path):
    cb = LearningRateMonitor(log_momentum=True)
    with pytest.warns(RuntimeWarning, match="some optimizers do not have momentum"):
        _lr_fit(tmp_path, cb, _TwoGroups("ASGD"))
    assert set(cb.last_momentum_values.values()) == {0.0}


def test_lr_monitor_errors_are_lightnings(tmp_path):
    with pytest.raises(MisconfigurationException, match="duplicated parameter group names {'x'}"):
        _lr_fit(tmp_path, LearningRateMonitor(), _TwoGroups(names=("x", "x")))
    with pytest.raises(MisconfigurationException, match="Cannot use `LearningRateMonitor` callback with `Trainer` "
                                                        "that has no logger"):
        Trainer(default_root_dir=tmp_path, callbacks=[LearningRateMonitor()], logger=False, max_epochs=1,
                enable_progress_bar=False, enable_model_summary=False).fit(_TwoGroups())


def test_callback_hooks_take_lightnings_pl_module_keyword():
    """Lightning's hooks name their second argument ``pl_module``; code calls them by keyword."""
    import inspect

    from zerotrain import callbacks as ours

    for cls in (ours.Callback, ours.Timer, ours.TQDMProgressBar, ours.LearningRateMonitor, ours.EarlyStopping,
                ours.ModelSummary):
        for hook in ("on_train_start", "on_train_epoch_end", "on_validation_end", "setup"):
            assert list(inspect.signature(getattr(cls, hook)).parameters)[1:3] == ["trainer", "pl_module"], (cls, hook)
    ours.Timer().on_train_start(trainer=mock.Mock(), pl_module=mock.Mock())


def test_timer_arguments_as_lightnings():
    from datetime import timedelta

    from zerotrain.callbacks import Timer

    assert Timer({"seconds": 1337})._duration == 1337 and Timer()._duration is None
    with pytest.raises(MisconfigurationException, match="format DD:HH:MM:SS"):
        Timer("6:00:00")
    with pytest.raises(MisconfigurationException, match="Unsupported parameter value `Timer.interval=invalid.`"):
        Timer(timedelta(), interval="invalid")


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_timer_with_no_time_left_stops_before_the_first_step(tmp_path, interval):
    """Lightning checks the budget at fit start (a resumed, spent Timer trains nothing) and counts
    training time from ``on_train_start``."""
    from datetime import timedelta

    from zerotrain.callbacks import Timer

    trainer = Trainer(default_root_dir=tmp_path, callbacks=[Timer(timedelta(0), interval=interval)], **_QUIET)
    trainer.fit(_module(TrainModule, range(10)))
    pl = pytest.importorskip("pytorch_lightning")
    theirs = pl.Trainer(default_root_dir=tmp_path, callbacks=[pl.callbacks.Timer(timedelta(0), interval=interval)],
                        accelerator="cpu", **_QUIET)
    theirs.fit(_module(pl.LightningModule, range(10)))
    assert (trainer.global_step, trainer.current_epoch) == (theirs.global_step, theirs.current_epoch) == (0, 0)


def test_timer_tracks_the_test_stage(tmp_path):
    from zerotrain.callbacks import Timer

    class M(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def test_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def test_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timer = Timer()
    Trainer(default_root_dir=tmp_path, callbacks=[timer], **_QUIET).test(M())
    assert timer.time_elapsed("test") > 0 and timer.end_time("test") is not None
    assert set(timer.state_dict()["time_elapsed"]) == {"train", "sanity_check", "validate", "test", "predict"}


class _Recorder:
    """A callback (for either library) recording the evaluation hooks it sees."""

    def __init__(self, base):
        class Recorder(base):
            def __init__(self):
                self.seen = []

            def on_sanity_check_start(self, trainer, pl_module):
                self.seen.append(("sanity_start", trainer.sanity_checking))

            def on_sanity_check_end(self, trainer, pl_module):
                self.seen.append(("sanity_end", list(trainer.num_sanity_val_batches)))

            def on_validation_epoch_end(self, trainer, pl_module):
                self.seen.append(("val_end", list(trainer.num_val_batches)))

        self.callback = Recorder()


def _val_module(base):
    class WithVal(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2)

    return WithVal()


@pytest.mark.parametrize("limit_val_batches", [0, 3])
def test_sanity_check_hooks_and_evaluation_batch_counts_as_lightning(tmp_path, limit_val_batches):
    """``on_sanity_check_start/end`` reach the callbacks, ``num_sanity_val_batches`` /
    ``num_val_batches`` hold the per-loader counts (the bars' totals), and a validation without
    batches runs no hook, as Lightning."""
    kw = dict(_QUIET, max_epochs=1, num_sanity_val_steps=2, limit_val_batches=limit_val_batches)
    ours = _Recorder(__import__("zerotrain").Callback).callback
    Trainer(default_root_dir=tmp_path, callbacks=[ours], **kw).fit(_val_module(TrainModule))
    pl = pytest.importorskip("pytorch_lightning")
    theirs = _Recorder(pl.Callback).callback
    pl.Trainer(default_root_dir=tmp_path, callbacks=[theirs], accelerator="cpu", **kw).fit(
        _val_module(pl.LightningModule))
    assert ours.seen == theirs.seen
    assert ours.seen == ([] if not limit_val_batches else
                         [("sanity_start", True), ("val_end", [3]), ("sanity_end", [2]), ("val_end", [3])])
