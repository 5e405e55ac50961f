"""Automatic optimization's LR schedulers and clipping hook, beside pytorch-lightning 2.6 on one
process: when each kind of scheduler steps (per step with ``frequency``, per epoch before the
epoch's validation, ReduceLROnPlateau on a monitored metric after it), ``lr_scheduler_step`` and
``configure_gradient_clipping`` overrides, and the learning rate every hook sees."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.trainer.errors import ConfigError


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)


def _data(n=24):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 2, generator=g))


def make(base, schedulers, clip_hook=False, step_hook=False):
    """One class body for a LightningModule and a TrainModule (the port is the rename). Records
    the LR seen in each batch, validation and epoch-end hook, and each clip/step hook call."""

    class M(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(5, 2)
            self.seen = []

        def _lr(self):
            return round(self.trainer.optimizers[0].param_groups[0]["lr"], 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_metric", loss.detach(), on_step=False, on_epoch=True)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.seen.append(("batch", self.trainer.global_step, self._lr()))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_metric", 1.0 + 0.0 * nn.functional.mse_loss(self.net(x), y))

        def on_validation_epoch_start(self):
            self.seen.append(("val", self.trainer.global_step, self._lr()))

        def on_train_epoch_end(self):
            self.seen.append(("epoch_end", self.current_epoch, self._lr()))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            out = schedulers(opt)  # a dict of scheduler keys, or the whole return value
            return out if isinstance(out, (list, tuple)) else {"optimizer": opt, **out}

        if clip_hook:
            def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
                self.seen.append(("clip", self.trainer.global_step, gradient_clip_val, gradient_clip_algorithm))
                if self.trainer.global_step % 2 == 0:  # clip every other step, by value
                    self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="value")

        if step_hook:
            def lr_scheduler_step(self, scheduler, metric):
                self.seen.append(("sched", self.trainer.global_step, metric is not None))
                scheduler.step() if metric is None else scheduler.step(metric)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=4)

        def val_dataloader(self):
            return DataLoader(_data(8), batch_size=4)

    return M()


def _both(schedulers, clip_hook=False, step_hook=False, **kw):
    pl = pytest.importorskip("pytorch_lightning")
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, max_epochs=3)
    common.update(kw)
    ours, theirs = make(TrainModule, schedulers, clip_hook, step_hook), make(pl.LightningModule, schedulers,
                                                                                 clip_hook, step_hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**common).fit(theirs)
    Trainer(**common).fit(ours)
    assert ours.seen == theirs.seen
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v, v2, rtol=0, atol=0)  # tolerance: exact: one process, Lightning's ops and order
    return ours.seen


def test_epoch_scheduler_steps_after_the_last_batch_before_validation_as_lightning():
    seen = _both(lambda opt: {"lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)})
    # the epoch's validation and on_train_epoch_end already see the next epoch's learning rate
    assert ("val", 6, 0.05) in seen and ("epoch_end", 0, 0.05) in seen


def test_lists_of_optimizers_and_schedulers_step_per_epoch_as_lightning():
    """``[opts], [scheds]``: the scheduler's default interval is the epoch (zerotrain's own
    ``(optimizer, scheduler)`` pair is per step): the LR of every training step equals Lightning's."""
    seen = _both(lambda opt: ([opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]))
    per_batch = [lr for kind, _, lr in seen if kind == "batch"]
    assert len(per_batch) == 18 and per_batch[:5] == [0.1] * 5 and per_batch[6:11] == [0.05] * 5


def test_step_scheduler_with_frequency_as_lightning():
    seen = _both(lambda opt: {"lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                                               "interval": "step", "frequency": 4}}, val_check_interval=3)
    assert [lr for kind, _, lr in seen if kind == "batch"][:5] == [0.1, 0.1, 0.1, 0.05, 0.05]


def test_reduce_on_plateau_steps_on_the_monitored_metric_as_lightning():
    for monitor in ("val_metric", "train_metric"):
        _both(lambda opt: {"lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
                           "monitor": monitor})


def test_reduce_on_plateau_needs_its_metric_and_a_monitor():
    with pytest.raises(ConfigError, match="ReduceLROnPlateau conditioned on metric nope which is not available"):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                max_epochs=1, num_sanity_val_steps=0).fit(
            make(TrainModule, lambda opt: {"lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                                           "monitor": "nope"}))
    with pytest.raises(ConfigError, match="must include a monitor when a `ReduceLROnPlateau`"):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                max_epochs=1).fit(
            make(TrainModule, lambda opt: {"lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}))


def test_lr_scheduler_step_and_configure_gradient_clipping_overrides_are_called_as_lightning():
    seen = _both(lambda opt: {"lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9),
                                               "interval": "step"}},
                 clip_hook=True, step_hook=True, max_epochs=1)
    assert ("clip", 0, None, None) in seen and ("sched", 1, False) in seen


def test_clip_gradients_refuses_a_value_other_than_the_trainers_as_lightning():
    with pytest.raises(ConfigError, match=r"You have set `Trainer\(gradient_clip_val=0.5\)` and have passed"):
        Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                max_epochs=1, num_sanity_val_steps=0, gradient_clip_val=0.5).fit(
            make(TrainModule, lambda opt: {}, clip_hook=True))


def test_learning_rate_monitor_names_its_metrics_as_lightning(tmp_path):
    """Two optimizers of one class (one with named param groups) and one of another: the metric
    names Lightning's LearningRateMonitor writes (their values and steps are zerotrain's)."""
    pl = pytest.importorskip("pytorch_lightning")

    def make_module(base):
        class Three(base):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                self.a, self.b, self.c = nn.Linear(5, 2), nn.Linear(5, 2), nn.Linear(5, 2)

            def training_step(self, batch, batch_idx):
                x, y = batch
                for opt, net in zip(self.optimizers(), (self.a, self.b, self.c)):
                    self.manual_backward(nn.functional.mse_loss(net(x), y))
                    opt.step()
                    opt.zero_grad()

            def configure_optimizers(self):
                return [torch.optim.SGD(self.a.parameters(), lr=0.1),
                        torch.optim.SGD([{"params": [self.b.weight], "name": "w"},
                                         {"params": [self.b.bias], "name": "b"}], lr=0.2),
                        torch.optim.Adam([{"params": [self.c.weight]}, {"params": [self.c.bias]}], lr=0.3)]

            def train_dataloader(self):
                return DataLoader(_data(), batch_size=4)
        return Three()

    names = {}
    for lib, (logger, _, _) in _fit_with_lr_monitor(pl, tmp_path, make_module, {}, max_epochs=1,
                                                    log_every_n_steps=1).items():
        with open(f"{logger.log_dir}/metrics.csv") as f:
            names[lib] = {n for n in f.readline().strip().split(",") if n.startswith("lr-")}
    assert names["zt"] == names["pl"] == {"lr-SGD", "lr-SGD-1/w", "lr-SGD-1/b", "lr-Adam/pg1", "lr-Adam/pg2"}


def _fit_with_lr_monitor(pl, tmp_path, make_module, monitor_kwargs: dict, **trainer_kwargs) -> dict:
    """The module fitted under Lightning ("pl") and zerotrain ("zt"), each with its own
    LearningRateMonitor and CSVLogger: per library (logger, monitor, trainer)."""
    import zerotrain

    out = {}
    for lib, trainer_cls, monitor_cls, logger_cls, base in (
            ("pl", pl.Trainer, pl.callbacks.LearningRateMonitor, pl.loggers.CSVLogger, pl.LightningModule),
            ("zt", Trainer, zerotrain.LearningRateMonitor, zerotrain.CSVLogger, TrainModule)):
        logger, monitor = logger_cls(str(tmp_path / lib)), monitor_cls(**monitor_kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = trainer_cls(accelerator="cpu", devices=1, logger=logger, callbacks=[monitor],
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  **trainer_kwargs)
            trainer.fit(make_module(base))
        logger.save()
        out[lib] = (logger, monitor, trainer)
    return out


@pytest.mark.parametrize("interval, every", [(None, 1), ("step", 2), ("epoch", 1)])
def test_learning_rate_monitor_logs_lightnings_rows(tmp_path, interval, every):
    """A per-step scheduler on one optimizer (named in its dict) and an epoch scheduler and a bare
    optimizer of the same class: every lr/momentum/weight-decay value the LearningRateMonitor
    sends to the logger, at its step, equals Lightning's (logged before each step's optimizer
    step, at the logging steps; per-epoch values at each epoch's start)."""
    pl = pytest.importorskip("pytorch_lightning")

    def make_module(base):
        class Two(base):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                torch.manual_seed(0)
                self.a, self.b, self.c = nn.Linear(5, 2), nn.Linear(5, 2), nn.Linear(5, 2)

            def training_step(self, batch, batch_idx):
                x, y = batch
                opts, scheds = self.optimizers(), self.lr_schedulers()
                for opt, net in zip(opts, (self.a, self.b, self.c)):
                    self.manual_backward(nn.functional.mse_loss(net(x), y))
                    opt.step()
                    opt.zero_grad()
                scheds[0].step()
                if self.trainer.is_last_batch:
                    scheds[1].step()

            def configure_optimizers(self):
                a = torch.optim.SGD(self.a.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
                b = torch.optim.Adam(self.b.parameters(), lr=0.2)
                c = torch.optim.SGD(self.c.parameters(), lr=0.3)
                return ([a, b, c],
                        [{"scheduler": torch.optim.lr_scheduler.StepLR(a, 1, gamma=0.5), "interval": "step",
                          "name": "warm"},
                         torch.optim.lr_scheduler.StepLR(b, 1, gamma=0.1)])

            def train_dataloader(self):
                return DataLoader(_data(), batch_size=4)
        return Two()

    import csv

    rows = {}
    runs = _fit_with_lr_monitor(pl, tmp_path, make_module, dict(logging_interval=interval, log_momentum=True,
                                                                log_weight_decay=True),
                                max_epochs=2, log_every_n_steps=every)
    for lib, (logger, mon, trainer) in runs.items():
        with open(f"{logger.log_dir}/metrics.csv", newline="") as f:
            rows[lib] = [{k: float(v) for k, v in r.items() if v != "" and k.startswith(("lr-", "warm", "step"))}
                         for r in csv.DictReader(f)]
        rows[lib] = [r for r in rows[lib] if len(r) > 1]
        rows[lib + "_lrs"] = mon.lrs
        rows[lib + "_cb"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("lr-", "warm"))}
    assert rows["zt"] and rows["zt"] == rows["pl"]
    assert rows["zt_lrs"] == rows["pl_lrs"] and rows["zt_cb"] == rows["pl_cb"]
