"""TensorBoardLogger and CSVLogger with Lightning's arguments, layout and objects, each beside
pytorch-lightning 2.6's: the same directories, files, event tags and CSV rows for the same calls."""
from __future__ import annotations

import os
from argparse import Namespace

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from zerotrain import Trainer
from zerotrain.demos import BoringModel
from zerotrain.loggers import CSVLogger, TensorBoardLogger


def _pl_loggers():
    return pytest.importorskip("pytorch_lightning").loggers


def _tags(log_dir):
    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {kind: sorted(tags) for kind, tags in acc.Tags().items() if tags not in (False, [])}


def _tb_run(cls, root, **kw):
    lg = cls(str(root), **kw)
    lg.log_hyperparams({1: "int key", "lr": 0.1, "nested": {"a": 1, "b": [1, 2]}})
    lg.log_hyperparams(None)
    lg.log_metrics({"loss": torch.tensor(0.5), "group": {"a": 1.0, "b": 2.0}}, step=3)
    lg.save()
    lg.finalize("success")
    with open(os.path.join(lg.log_dir, lg.NAME_HPARAMS_FILE)) as f:
        saved = yaml.safe_load(f)
    return os.path.relpath(lg.log_dir, root), sorted(saved, key=str), _tags(lg.log_dir)


def test_tensorboard_logger_layout_hparams_and_events_are_lightnings(tmp_path):
    pl_loggers = _pl_loggers()
    for kw in ({}, {"name": "run", "version": "v", "sub_dir": "sub", "prefix": "p"}, {"default_hp_metric": False}):
        ours = _tb_run(TensorBoardLogger, tmp_path / "ours" / str(len(kw)), **kw)
        theirs = _tb_run(pl_loggers.TensorBoardLogger, tmp_path / "theirs" / str(len(kw)), **kw)
        assert ours[0] == theirs[0]
        assert ours[1] == theirs[1]
        assert ours[2]["scalars"] == theirs[2]["scalars"]  # hp_metric (when default), prefixes, groups
    assert TensorBoardLogger.NAME_HPARAMS_FILE == "hparams.yaml"


def test_tensorboard_log_graph_as_lightning(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as Theirs

    for cls, model in ((TensorBoardLogger, BoringModel()), (pl.loggers.TensorBoardLogger, Theirs())):
        lg = cls(str(tmp_path / cls.__module__.split(".")[0]), log_graph=True)
        with pytest.warns(UserWarning, match="Could not log computational graph"):
            lg.log_graph(model)  # no example_input_array
        model.example_input_array = torch.randn(2, 32)
        lg.log_graph(model)
        lg.finalize("success")
        acc = EventAccumulator(lg.log_dir)
        acc.Reload()
        assert acc.Graph() is not None


def test_trainer_logger_true_writes_lightnings_default_folder(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as Theirs

    for trainer_cls, model, sub in ((Trainer, BoringModel(), "ours"), (pl.Trainer, Theirs(), "theirs")):
        trainer = trainer_cls(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, logger=True,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              default_root_dir=str(tmp_path / sub))
        trainer.fit(model)
        assert os.path.relpath(trainer.log_dir, tmp_path / sub) == os.path.join("lightning_logs", "version_0")
        assert os.path.isfile(os.path.join(trainer.log_dir, "hparams.yaml"))


def test_csv_logger_experiment_is_lightnings_writer(tmp_path):
    pl_loggers = _pl_loggers()
    results = []
    for cls, sub in ((CSVLogger, "ours"), (pl_loggers.CSVLogger, "theirs")):
        lg = cls(str(tmp_path / sub), name="n", version=3, prefix="p", flush_logs_every_n_steps=2)
        exp = lg.experiment
        lg.log_hyperparams(Namespace(lr=0.1, layers=2))
        lg.log_hyperparams(None)
        lg.log_metrics({"a": torch.tensor(1.0)}, step=0)
        rows_buffered = len(exp.metrics)
        lg.log_metrics({"a": 2.0, "b": 3.0}, step=1)  # (1 + 1) % 2 == 0: written
        lg.log_metrics({"a": 4.0}, step=2)
        lg.finalize("success")
        with open(exp.metrics_file_path) as f:
            csv_text = f.read()
        results.append((type(exp).__name__, os.path.relpath(exp.log_dir, tmp_path / sub), rows_buffered, csv_text,
                        dict(exp.hparams), lg.version, lg.name, os.path.relpath(lg.log_dir, tmp_path / sub)))
    assert results[0] == results[1]
    assert results[0][0] == "ExperimentWriter"


def test_csv_writer_replaces_an_earlier_runs_metrics_file(tmp_path):
    pl_loggers = _pl_loggers()
    for cls, sub in ((CSVLogger, "ours"), (pl_loggers.CSVLogger, "theirs")):
        old = tmp_path / sub / "exp" / "version_0" / "metrics.csv"
        old.parent.mkdir(parents=True)
        old.write_text("step,x\n0,1\n")
        lg = cls(save_dir=str(tmp_path / sub), name="exp", version=0)
        with pytest.warns(UserWarning, match="Experiment logs directory .* exists and is not empty"):
            lg.experiment  # noqa: B018
        assert not old.exists()


def test_model_checkpoint_without_dirpath_saves_in_the_loggers_folder(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as Theirs

    from zerotrain.callbacks import ModelCheckpoint

    found = []
    for trainer_cls, model, cb, sub in ((Trainer, BoringModel(), ModelCheckpoint(), "ours"),
                                        (pl.Trainer, Theirs(), pl.callbacks.ModelCheckpoint(), "theirs")):
        root = tmp_path / sub
        trainer_cls(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=1, logger=CSVLogger(str(root))
                    if trainer_cls is Trainer else pl.loggers.CSVLogger(str(root)), callbacks=[cb],
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root)).fit(model)
        found.append(os.path.relpath(cb.dirpath, root))
    assert found[0] == found[1] == os.path.join("lightning_logs", "version_0", "checkpoints")
