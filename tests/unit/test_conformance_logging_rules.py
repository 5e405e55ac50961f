"""Issue 41, logging slice: what is logged and when, as pytorch-lightning 2.6 does it. A returned loss
is not logged; a callback's ``self.log`` is the module's; ``_current_fx_name`` is the running hook;
one-element tensors are logged 0-dim; the loggers are finalized at the end of every stage; the
ranks' watch thread ends with the stage; ``PL_TRAINER_*`` variables and ``plugins=`` are taken;
``detect_anomaly`` leaves a nan to torch; TensorBoard hyperparameters and ``hparams.yaml`` take what
Lightning's take. Where useful, pytorch-lightning runs the same module in the same test."""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import Callback, TQDMProgressBar
from zerotrain.loggers import Logger, TensorBoardLogger
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.launch.launcher import LocalLauncher
from zerotrain.trainer.api.saving import load_hparams_from_yaml, save_hparams_to_yaml

pytestmark = pytest.mark.timeout(120)

_QUIET = dict(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _module(base, step_log=None, extra=None):
    """A small module on ``base`` (ours or Lightning's); ``step_log(self)`` runs in training_step."""

    class Net(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            if step_log is not None:
                step_log(self)
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def test_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def _data(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

        train_dataloader = val_dataloader = test_dataloader = _data

    for name, fn in (extra or {}).items():
        setattr(Net, name, fn)
    return Net()


def _lightning():
    return pytest.importorskip("pytorch_lightning")


def test_a_returned_loss_is_not_logged_as_lightning(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, logger=False, **_QUIET)
    model = _module(TrainModule)
    trainer.fit(model)
    assert trainer.callback_metrics == {} and trainer.progress_bar_metrics == {}
    assert trainer.test(model, verbose=False) == [{}]
    pl = _lightning()
    theirs = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, logger=False, accelerator="cpu", **_QUIET)
    theirs.fit(_module(pl.LightningModule))
    assert dict(theirs.callback_metrics) == {}


class _LoggingCallback(Callback):
    def on_train_start(self, trainer, pl_module):
        self.log("on_train_start", 1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.log("on_train_batch_end", 3)

    def on_train_epoch_end(self, trainer, pl_module):
        self.log_dict({"on_train_epoch_end": 5})


def test_a_callbacks_self_log_is_the_modules_under_the_hooks_name(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1, logger=False,
                      callbacks=[_LoggingCallback()], **_QUIET)
    trainer.fit(_module(TrainModule))
    assert {k: float(v) for k, v in trainer.callback_metrics.items()} == {
        "on_train_start": 1, "on_train_batch_end": 3, "on_train_epoch_end": 5}
    with pytest.raises(ConfigError, match="outside the Trainer's control flow"):
        _LoggingCallback().log("x", 1)  # no hook running


def test_callback_log_is_no_member_of_the_class_so_every_hook_lambda_works(tmp_path):
    """Lightning's Callback has no ``log``/``log_dict`` members (it sets them on each callback), so
    a LambdaCallback of every member of the class (Lightning's test_lambda_call) must be valid."""
    import inspect

    from zerotrain.callbacks import Callback, LambdaCallback

    members = {m for m, _ in inspect.getmembers(Callback, inspect.isfunction) if not m.startswith("_")}
    members -= {"state_dict", "load_state_dict"}
    assert not {"log", "log_dict"} & members
    LambdaCallback(**{m: (lambda *a, **k: None) for m in members})
    with pytest.raises(ConfigError, match="outside the Trainer's control flow"):
        Callback().log("x", 1.0)  # outside a hook: a clear error when called


def test_current_fx_name_is_the_running_hook_and_none_after(tmp_path):
    seen = []
    model = _module(TrainModule, step_log=lambda m: seen.append(m._current_fx_name))
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, **_QUIET)
    trainer.fit(model)
    assert seen == ["training_step"] and model._current_fx_name is None
    trainer.test(model, verbose=False)
    assert model._current_fx_name is None


def test_a_one_element_tensor_is_logged_0_dim_also_outside_the_loop():
    """Lightning's own test logs by hand: the stage set, ``_current_fx_name`` set, no loop running."""
    from zerotrain.trainer.loop.state import RunningStage

    model, trainer = _module(TrainModule), Trainer(logger=False, **_QUIET)
    trainer.state.stage = RunningStage.TRAINING
    model._current_fx_name = "training_step"
    model.trainer = trainer
    model.log("foo", torch.tensor([1.2]), on_epoch=True)
    assert trainer.callback_metrics["foo"].ndim == 0


class _BufferLogger(Logger):
    """Buffers rows and keeps them only at ``finalize`` (Lightning's test logger)."""

    def __init__(self):
        super().__init__()
        self.buffer, self.logs, self.statuses = {}, {}, []

    def log_metrics(self, metrics, step=None):
        self.buffer.update(metrics)

    def finalize(self, status):
        self.logs.update(self.buffer)
        self.buffer = {}
        self.statuses.append(status)

    def log_hyperparams(self, *args, **kwargs):
        pass

    experiment = property(lambda self: None)
    version = property(lambda self: 1)
    name = property(lambda self: "buffer")


class _Observer(Callback):
    def on_test_end(self, trainer, pl_module):
        trainer.logger.log_metrics({"test": 1})

    def on_predict_end(self, trainer, pl_module):
        trainer.logger.log_metrics({"predict": 1})


def test_the_loggers_are_finalized_at_the_end_of_every_stage(tmp_path):
    logger = _BufferLogger()
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=logger, callbacks=[_Observer()], **_QUIET)
    model = _module(TrainModule)
    trainer.fit(model)
    trainer.test(model, verbose=False)
    assert logger.logs == {"test": 1} and logger.statuses == ["success", "success"]
    trainer.predict(model, DataLoader(torch.randn(2, 2)))
    assert logger.logs == {"test": 1, "predict": 1}


def test_the_watch_thread_ends_when_the_stage_returns(tmp_path):
    class Recorder:
        calls = []

        def watch(self):
            self.calls.append("watch")

        def unwatch(self):
            self.calls.append("unwatch")

    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, **_QUIET)
    model = _module(TrainModule)
    trainer.fit(model)
    trainer._launcher = Recorder()  # set up once; a later stage watches only while it runs
    trainer.validate(model, verbose=False)
    assert Recorder.calls == ["watch", "unwatch"]
    launcher = LocalLauncher(info=None)  # no ranks started: the thread itself
    launcher.watch()
    assert any(t.name == "zerotrain-watchdog" for t in threading.enumerate())
    launcher.unwatch()
    assert not any(t.name == "zerotrain-watchdog" for t in threading.enumerate())


def test_pl_trainer_environment_variables_are_defaults(monkeypatch):
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")  # not a literal: kept as text
    trainer = Trainer()
    assert trainer.logger is None and trainer.max_steps == 7 and trainer.accelerator == "cpu"
    assert Trainer(max_steps=42).max_steps == 42  # an argument passed wins


def test_plugins_none_or_empty_is_taken_and_an_object_refused():
    Trainer(plugins=None, logger=False)
    Trainer(plugins=[], logger=False)
    with pytest.raises(ConfigError, match=r"plugins=.*valid: None or \[\]"):
        Trainer(plugins=[object()], logger=False)


def test_detect_anomaly_leaves_a_nan_loss_to_torchs_anomaly_mode(tmp_path):
    def nan_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean() * torch.tensor(float("nan"))

    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, detect_anomaly=True, **_QUIET)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="returned nan values in its 0th output"):
        warnings.simplefilter("ignore")  # torch's anomaly mode warns with the forward's traceback
        trainer.fit(_module(TrainModule, extra={"training_step": nan_step}))


def test_tensorboard_hyperparameters_take_arrays_and_tensors(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    params = {"tensor": torch.zeros(2, 2, 2), "array": np.zeros([2, 2, 2]), "np_float": np.float32(0.5),
              "layer": torch.nn.BatchNorm1d, "int": 1}
    logger.log_hyperparams(params, {"abc": torch.tensor([0.54])})
    logger.finalize("success")


def test_hparams_yaml_with_a_value_omegaconf_cannot_hold_reads_back_as_a_dict(tmp_path):
    path = tmp_path / "hparams.yaml"
    save_hparams_to_yaml(path, {"layer": torch.nn.BatchNorm1d, "lr": 0.1})
    back = load_hparams_from_yaml(path)
    assert back["layer"] is torch.nn.BatchNorm1d and back["lr"] == 0.1


def test_the_progress_bar_reads_its_metrics_after_the_sanity_check_as_lightning(tmp_path, monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread left behind

    class Bar(TQDMProgressBar):
        stages = []

        def get_metrics(self, trainer, pl_module):
            self.stages.append(str(trainer.state.stage.value))
            return super().get_metrics(trainer, pl_module)

    trainer = Trainer(default_root_dir=tmp_path, max_epochs=1, limit_train_batches=1, limit_val_batches=1,
                      logger=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[Bar()])
    trainer.fit(_module(TrainModule))
    assert Bar.stages == ["sanity_check", "train", "validate", "train"]


def test_loggers_can_be_set_and_none_is_no_loggers(tmp_path):
    trainer = Trainer(default_root_dir=tmp_path)
    logger = _BufferLogger()
    trainer.loggers = [logger]
    assert trainer.loggers == [logger] and trainer.logger is logger
    trainer.loggers = None
    assert trainer.loggers == [] and trainer.logger is None


def test_under_barebones_self_log_warns_and_logs_nothing():
    model, trainer = _module(TrainModule), Trainer(barebones=True)
    model.trainer = trainer
    with pytest.warns(UserWarning, match=r"barebones=True\)` is configured"):
        model.log("foo", 1.0)
    assert trainer.callback_metrics == {}


def test_the_verbose_results_table_is_lightnings(capsys, monkeypatch):
    """The text table (Rich off), checked cell by cell against pytorch-lightning's own printer."""
    from zerotrain.trainer.compat.lightning import internals

    monkeypatch.setattr(internals, "_RICH_AVAILABLE", False)
    results = [{"value": torch.tensor(2), "perf": {"a:1": torch.tensor(0)}, "acc/dataloader_idx_0": 0.5},
               {"other": torch.tensor(1.5), f"a {'really ' * 11}long name": torch.tensor([[6]])}]
    internals._EvaluationLoop._print_results(results, "test")
    ours = capsys.readouterr().out
    assert "Test metric" in ours and "perf:a:1" in ours and "DataLoader 1" in ours
    pytest.importorskip("lightning")
    import lightning.pytorch.loops.evaluation_loop as theirs

    monkeypatch.setattr(theirs, "_RICH_AVAILABLE", False)
    theirs._EvaluationLoop._print_results(results, "test")
    assert capsys.readouterr().out == ours


def test_should_update_logs_says_which_steps_reach_the_loggers(tmp_path):
    class Rows(_BufferLogger):
        steps = []

        def log_metrics(self, metrics, step=None):
            self.steps.append(step)

    due = []

    def step_log(module):
        module.log("foo", 1.0)
        due.append(module.trainer._logger_connector.should_update_logs)

    trainer = Trainer(default_root_dir=tmp_path, max_steps=4, limit_train_batches=4, log_every_n_steps=2,
                      logger=Rows(), **_QUIET)
    trainer.fit(_module(TrainModule, step_log=step_log))
    assert due == [False, True, False, True] and Rows.steps[:2] == [1, 3]


def test_the_csv_logger_writes_to_a_url_through_fsspec(tmp_path, monkeypatch):
    fsspec = pytest.importorskip("fsspec")
    from zerotrain.loggers import CSVLogger

    monkeypatch.chdir(tmp_path)  # nothing may land in a local folder named "memory:"
    logger = CSVLogger(save_dir="memory://zt_csv_url")
    logger.log_hyperparams({"lr": 0.1})
    logger.experiment.log_metrics({"loss": 0.1})
    logger.save()
    fs = fsspec.filesystem("memory")
    try:
        assert fs.isfile(f"{logger.log_dir}/metrics.csv") and fs.isfile(f"{logger.log_dir}/hparams.yaml")
        assert load_hparams_from_yaml(f"{logger.log_dir}/hparams.yaml") == {"lr": 0.1}
        assert os.listdir(tmp_path) == []
    finally:
        fs.rm("/zt_csv_url", recursive=True)
