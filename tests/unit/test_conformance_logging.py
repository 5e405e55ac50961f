"""Issue 41: ``self.log``'s refusals carry Lightning's words (Lightning's tests match them), and
the loggers get ``log_metrics(metrics=..., step=...)`` by keyword, as Lightning calls them. Where
useful, pytorch-lightning 2.6 runs the same module in the same test (skipped when it is missing)."""
from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.loggers import Logger
from zerotrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.timeout(120)


def _module(base, log):
    """``training_step`` calls ``log(self)`` then returns a loss."""

    class Logs(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            log(self)
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

    return Logs()


_QUIET = dict(max_steps=2, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _both_raise(tmp_path, log, error, match):
    """Our Trainer and Lightning's raise ``error`` matching ``match`` for the same ``self.log``."""
    with pytest.raises(error, match=match):
        Trainer(default_root_dir=tmp_path, logger=False, **_QUIET).fit(_module(TrainModule, log))
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.exceptions import MisconfigurationException as Theirs

    with pytest.raises(Theirs if error is MisconfigurationException else error, match=match):
        pl.Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu", **_QUIET).fit(
            _module(pl.LightningModule, log))


@pytest.mark.parametrize("value", [None, {"a": 1}, {"a": {"b": 1}}, "foo", [1, 2], (1, 2)])
def test_log_of_an_unloggable_value_names_the_call_as_lightning(tmp_path, value):
    _both_raise(tmp_path, lambda m: m.log("foo", value), ValueError,
                re.escape(f"`self.log(foo, {value})` was called"))


def test_log_refusals_use_lightnings_words(tmp_path):
    _both_raise(tmp_path, lambda m: m.log("foo/dataloader_idx_0", 1.0), MisconfigurationException,
                "`self.log` with the key `foo/dataloader_idx_0`")
    _both_raise(tmp_path, lambda m: m.log("foo", 1.0, on_step=False, on_epoch=False), MisconfigurationException,
                "is not useful")
    _both_raise(tmp_path, lambda m: (m.log("foo", 1.0, prog_bar=False), m.log("foo", 1.0, prog_bar=True)),
                MisconfigurationException, re.escape("`self.log(foo, ...)` twice in `training_step`"))


class _KeywordsOnly(Logger):
    """A logger that, like a mock asserting Lightning's calls, takes ``metrics``/``step`` by name only."""

    def __init__(self):
        super().__init__()
        self.rows = []

    @property
    def name(self):
        return "kw"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, *, metrics, step):
        self.rows.append((dict(metrics), step))


def test_loggers_get_metrics_and_step_by_keyword(tmp_path):
    logger = _KeywordsOnly()
    Trainer(default_root_dir=tmp_path, logger=logger, log_every_n_steps=1, **_QUIET).fit(
        _module(TrainModule, lambda m: m.log("foo", 3.0)))
    assert [(row["foo"], step) for row, step in logger.rows] == [(3.0, 0), (3.0, 1)]


def test_csv_logger_writes_hparams_yaml_at_log_hyperparams(tmp_path):
    """Lightning's CSV writer writes ``hparams.yaml`` as soon as hyperparameters are logged."""
    from zerotrain.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="exp", version="2020-02-05")
    logger.log_hyperparams({"a": 1, "b": 2})
    assert os.listdir(tmp_path / "exp") == ["2020-02-05"]
    assert os.listdir(tmp_path / "exp" / "2020-02-05") == ["hparams.yaml"]
    CSVLogger(tmp_path / "none", name=None).log_hyperparams()
    assert os.listdir(tmp_path / "none" / "version_0") == ["hparams.yaml"]


def test_log_dir_follows_overridden_name_and_version(tmp_path):
    """A logger subclass overriding ``name``/``version`` writes there, as Lightning's ``log_dir``."""
    from zerotrain.loggers import CSVLogger, TensorBoardLogger

    for base in (CSVLogger, TensorBoardLogger):
        class Renamed(base):
            name = property(lambda self: "name")
            version = property(lambda self: "version")

        assert Renamed(tmp_path).log_dir == os.path.join(tmp_path, "name", "version")
        assert Renamed(tmp_path).root_dir == os.path.join(tmp_path, "name")
    assert TensorBoardLogger(tmp_path, sub_dir="s").log_dir == os.path.join(tmp_path, "lightning_logs", "version_0", "s")


def test_dummy_logger_takes_any_arguments():
    from zerotrain.loggers.logger import DummyLogger

    logger = DummyLogger()
    logger.log_hyperparams("1", 2, three="three")
    logger.log_metrics("1", 2, three="three")
    assert callable(logger.log_text)


def test_loggers_experiments_exist_at_setup_and_pickle(tmp_path):
    """Lightning makes each logger's experiment before the ``setup`` hooks, and a Trainer holding a
    TensorBoardLogger whose writer exists pickles (the writer is left out)."""
    import pickle

    from zerotrain import Callback
    from zerotrain.loggers import CSVLogger, TensorBoardLogger

    seen = []

    class AtSetup(Callback):
        def setup(self, trainer, pl_module, stage):
            seen.extend(lg._experiment is not None for lg in trainer.loggers)

    loggers = [CSVLogger(tmp_path), TensorBoardLogger(tmp_path)]
    trainer = Trainer(default_root_dir=tmp_path, logger=loggers, callbacks=[AtSetup()], **_QUIET)
    trainer.fit(_module(TrainModule, lambda m: None))
    assert seen == [True, True]
    loggers[1].log_metrics({"a": 1.0})
    again = pickle.loads(pickle.dumps(loggers[1]))
    again.log_metrics({"a": 2.0})
    assert again.log_dir == loggers[1].log_dir
    for writer in (loggers[1], again):  # their SummaryWriters' threads end here
        writer.finalize("success")
