"""``self.log`` / ``self.log_dict`` with Lightning's semantics: the same module, logging with every
combination of on_step / on_epoch, reduce_fx, prog_bar, logger and batch_size (an uneven last
batch weights the epoch means), in training, in the batch and epoch hooks, in validation and in
test, runs under zerotrain and under pytorch-lightning 2.6 in the same test; the metric dicts
(``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``), the rows each library's
CSVLogger wrote (step, epoch, names, values) and what ``validate``/``test`` return are compared."""
from __future__ import annotations

import csv
import logging
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.loggers import CSVLogger
from zerotrain.trainer.errors import ConfigError

from tolerance import mean_rtol  # tests/ is on sys.path (conftest)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch, tmp_path):
    """pytorch-lightning sets this variable when its Trainer starts: restore the environment after;
    both Trainers write under tmp_path."""
    monkeypatch.chdir(tmp_path)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def make_module(base, plan="all"):
    """One module for both libraries. ``plan``: "all" logs everything below; other plans pick
    one behaviour for the focused tests."""

    class Logs(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)

        def _loss(self, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def training_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("a", loss)  # per step (the default in training_step)
            self.log("b", loss, on_step=True, on_epoch=True, prog_bar=True)  # b_step and b_epoch
            if plan == "all":
                self.log("c", loss * 2, on_step=False, on_epoch=True, reduce_fx="sum")
                self.log("d", batch[0].max(), on_epoch=True, reduce_fx=torch.max, logger=False)
                self.log("m", batch[0].min(), on_epoch=True, on_step=False, reduce_fx="min", prog_bar=True)
                self.log_dict({"e": float(batch_idx), "f": torch.tensor(2)}, on_epoch=True)
                self.log("w", loss, on_step=False, on_epoch=True, batch_size=1)  # unweighted mean
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if plan == "all":
                self.log("g", float(batch_idx) * 10)

        def on_train_epoch_end(self):
            if plan == "all":
                self.log("h", float(self.trainer.current_epoch), prog_bar=True)

        def validation_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("val_loss", loss, prog_bar=True)  # the epoch mean, weighted by batch size
            if plan == "all":
                self.log("val_min", loss, reduce_fx=torch.min)
                self.log("val_both", loss, on_step=True)  # val_both_step per batch, val_both_epoch
                self.log("val_hidden", loss, logger=False)

        def on_validation_epoch_end(self):
            if plan == "all":
                self.log("val_end", 3.0)

        def test_step(self, batch, batch_idx):
            loss = self._loss(batch)
            self.log("test_loss", loss)
            if plan == "all":
                self.log("test_step_only", loss, on_step=True, on_epoch=False)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(_data(10, 0), batch_size=4)  # 4, 4, 2: an uneven last batch

        def val_dataloader(self):
            return DataLoader(_data(7, 1), batch_size=3)  # 3, 3, 1

        def test_dataloader(self):
            return DataLoader(_data(5, 2), batch_size=2)

    return Logs()


QUIET = dict(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _run(lib, tmp_path, plan="all", stages=("fit", "validate", "test"), **kw):
    """Fit, validate and test one module under ``lib`` with a CSVLogger; returns per stage the
    metric dicts (as numbers) and what validate/test returned, and the CSV rows."""
    if lib == "pl":
        pl = pytest.importorskip("pytorch_lightning")
        logger = pl.loggers.CSVLogger(str(tmp_path / lib))
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=logger, **{**QUIET, **kw})
        module = make_module(pl.LightningModule, plan)
    else:
        logger = CSVLogger(str(tmp_path / lib))
        trainer = Trainer(accelerator="cpu", devices=1, logger=logger, stall_timeout_s=None, **{**QUIET, **kw})
        module = make_module(TrainModule, plan)
    out = {}
    for stage in stages:
        returned = getattr(trainer, stage)(module, **({} if stage == "fit" else {"verbose": False}))
        out[stage] = {"callback": _numbers(trainer.callback_metrics), "logged": _numbers(trainer.logged_metrics),
                      "pbar": dict(trainer.progress_bar_metrics), "returned": returned}
    logger.save()
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as f:
        out["rows"] = list(csv.DictReader(f))
    return out


def _numbers(metrics):
    return {k: float(v) for k, v in metrics.items()}


def test_metric_dicts_csv_rows_and_results_match_lightning(tmp_path):
    ours = _run("zt", tmp_path, max_epochs=2, log_every_n_steps=2)
    theirs = _run("pl", tmp_path, max_epochs=2, log_every_n_steps=2)
    for stage in ("fit", "validate", "test"):
        for what in ("callback", "logged", "pbar", "returned"):
            assert ours[stage][what] == theirs[stage][what], (stage, what)
    assert ours["rows"] == theirs["rows"]
    # what the comparison covers, spelled out
    fit = ours["fit"]
    assert {"a", "b", "b_step", "b_epoch", "c", "d", "d_step", "d_epoch", "val_loss", "val_end"} <= set(fit["callback"])
    assert "d_step" not in fit["logged"] and "val_hidden" not in fit["logged"]  # logger=False
    assert set(fit["pbar"]) == {"b_step", "b_epoch", "m", "h", "val_loss"}
    steps = [(r["step"], r["epoch"]) for r in ours["rows"] if r.get("a")]
    assert steps == [("1", "0"), ("3", "1"), ("5", "1")]  # every 2nd step (3 a epoch), at the step trained at


def test_batch_size_weights_the_epoch_mean(tmp_path):
    ours = _run("zt", tmp_path, plan="loss", stages=("fit",), max_epochs=1, num_sanity_val_steps=0)
    m = make_module(TrainModule, "loss")  # the weights the validation ran with: after 3 SGD steps
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for batch in m.train_dataloader():
        opt.zero_grad()
        m._loss(batch).backward()
        opt.step()
    with torch.no_grad():
        x, y = _data(7, 1).tensors
        expected = float(torch.nn.functional.mse_loss(m.net(x), y))
    # tolerance: the batch means (3, 3, 1 samples) weighted by size vs one 7-term mean: 2 mean_rtol(7, ops=3) of the (positive) mean
    assert abs(ours["fit"]["callback"]["val_loss"] - expected) <= 2 * mean_rtol(7, ops=3) * expected


@pytest.mark.parametrize("every", [1, 3])
def test_log_every_n_steps_rows_match_lightning(tmp_path, every):
    ours = _run("zt", tmp_path, plan="loss", stages=("fit",), max_epochs=2, log_every_n_steps=every)
    theirs = _run("pl", tmp_path, plan="loss", stages=("fit",), max_epochs=2, log_every_n_steps=every)
    assert ours["rows"] == theirs["rows"]
    assert ours["fit"] == theirs["fit"]


def test_accumulated_batches_log_once_per_optimizer_step(tmp_path):
    kw = dict(plan="loss", stages=("fit",), max_epochs=2, log_every_n_steps=1, accumulate_grad_batches=2)
    assert _run("zt", tmp_path, **kw)["rows"] == _run("pl", tmp_path, **kw)["rows"]


# ---------------------------------------------------------------------------- errors, as Lightning's
class _Bad(TrainModule):
    def __init__(self, how):
        super().__init__()
        self.net, self.how = torch.nn.Linear(4, 1), how

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        how = self.how
        if how == "vector":
            self.log("v", batch[0][:, 0])
        elif how == "reduce":
            self.log("v", loss, reduce_fx="median")
        elif how == "string":
            self.log("v", "text")
        elif how == "nested":
            self.log("v", {"x": 1.0})
        elif how == "neither":
            self.log("v", loss, on_step=False, on_epoch=False)
        elif how == "twice":
            self.log("v", loss)
            self.log("v", loss, prog_bar=True)
        elif how == "suffix":
            self.log("v/dataloader_idx_0", loss)
        return loss

    def on_train_epoch_end(self):
        if self.how == "epoch_hook_step":
            self.log("v", 1.0, on_step=True)

    def on_fit_start(self):
        if self.how == "fit_start":
            self.log("v", 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(4, 0), batch_size=2)


@pytest.mark.parametrize("how, error, words", [
    ("vector", ValueError, "single element"), ("reduce", ConfigError, "reduce_fx='median'"),
    ("string", ValueError, "`str` values cannot be logged"), ("nested", ValueError, "nested dictionaries"),
    ("neither", ConfigError, "on_step=False, on_epoch=False"), ("twice", ConfigError, "different arguments"),
    ("suffix", ConfigError, "dataloader_idx"), ("epoch_hook_step", ConfigError, "on_step=True inside on_train_epoch_end"),
    ("fit_start", ConfigError, "inside on_fit_start"),
])
def test_what_lightning_refuses_is_refused(how, error, words):
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, stall_timeout_s=None, max_epochs=1, **QUIET)
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        trainer.fit(_Bad(how))


def test_int_values_and_ambiguous_batches_warn_as_lightning(caplog):
    class Ambiguous(_Bad):
        def training_step(self, batch, batch_idx):
            loss = super().training_step((batch[0], batch[1]), batch_idx)
            self.log("n", torch.tensor(3), on_epoch=True)
            return loss

        def train_dataloader(self):
            data = TensorDataset(torch.randn(4, 4), torch.randn(4, 1))
            return DataLoader(data, batch_size=2, collate_fn=lambda rows: [torch.stack([r[0] for r in rows]),
                                                                           torch.stack([r[1] for r in rows])[:1]])

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, stall_timeout_s=None, max_epochs=1, **QUIET)
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        trainer.fit(Ambiguous("none"))
    text = caplog.text
    assert "needs to be floating" in text and "ambiguous collection" in text
    assert float(trainer.callback_metrics["n"]) == 3.0 and trainer.callback_metrics["n"].dtype == torch.float32


def _two_loader_run(lib, tmp_path):
    """validate over two loaders (names get ``/dataloader_idx_<i>``; a name logged with
    ``add_dataloader_idx=False`` is shared), with a callback logging through ``pl_module.log``."""
    if lib == "pl":
        pl = pytest.importorskip("pytorch_lightning")
        base, cb_base, trainer_cls = pl.LightningModule, pl.Callback, pl.Trainer
        logger = pl.loggers.CSVLogger(str(tmp_path / lib))
        extra = {}
    else:
        from zerotrain import Callback
        base, cb_base, trainer_cls, logger, extra = TrainModule, Callback, Trainer, CSVLogger(str(tmp_path / lib)), \
            {"stall_timeout_s": None}

    class FromCallback(cb_base):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            pl_module.log("cb_seen", float(batch_idx + 10 * dataloader_idx))

    class Two(make_module(base, "loss").__class__):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            loss = self._loss(batch)
            self.log("val_loss", loss)
            self.log(f"shared_{dataloader_idx}", loss, add_dataloader_idx=False, on_step=True)

    trainer = trainer_cls(accelerator="cpu", devices=1, logger=logger, callbacks=[FromCallback()],
                          **QUIET, **extra)
    module = Two()
    loaders = [DataLoader(_data(7, 1), batch_size=3), DataLoader(_data(4, 3), batch_size=2)]
    returned = trainer.validate(module, dataloaders=loaders, verbose=False)
    logger.save()
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return returned, _numbers(trainer.callback_metrics), _numbers(trainer.logged_metrics), rows


def test_several_loaders_and_callback_logging_match_lightning(tmp_path):
    ours, theirs = _two_loader_run("zt", tmp_path), _two_loader_run("pl", tmp_path)
    assert ours == theirs
    returned = ours[0]
    assert set(returned[0]) == {"val_loss/dataloader_idx_0", "cb_seen/dataloader_idx_0", "shared_0_epoch"}
