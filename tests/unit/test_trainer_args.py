"""Lightning's Trainer arguments: fast_dev_run, num_sanity_val_steps, check_val_every_n_epoch,
min_epochs/min_steps, max_time, overfit_batches, gradient_clip_algorithm, enable_model_summary,
detect_anomaly and callbacks given as one callback. Where the effect is observable (steps and
batches run, the step where min_epochs overrides an early stop, value-clipped parameters), the
same module runs under pytorch-lightning 2.6 in the same test."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks.base import Callback, Logger
from zerotrain.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, Timer
from zerotrain.trainer.errors import ConfigError


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch, tmp_path):
    """pytorch-lightning sets this variable when its Trainer starts: restore the environment after;
    both Trainers write under tmp_path."""
    monkeypatch.chdir(tmp_path)


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def make_module(base, n_train=16, n_val=8, shuffle=False, lr=0.1, stop_at_val=None):
    """One module for both libraries: records the training and validation batches it sees (by
    their first input value) and, with ``stop_at_val``, asks to stop after that many validations."""

    class Recorder(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(4, 1)
            self.train_seen, self.val_seen, self.vals = [], [], 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.train_seen.append(round(float(x[0, 0]), 5))
            return torch.nn.functional.mse_loss(self.net(x), y) * 100

        def validation_step(self, batch, batch_idx):
            self.val_seen.append(round(float(batch[0][0, 0]), 5))
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
            if batch_idx == 0 and not self.trainer.sanity_checking:  # (module hooks: another change)
                self.vals += 1
                if stop_at_val is not None and self.vals >= stop_at_val:
                    self.trainer.should_stop = True

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

        def train_dataloader(self):
            return DataLoader(_data(n_train), batch_size=2, shuffle=shuffle)

        def val_dataloader(self):
            return DataLoader(_data(n_val, seed=1), batch_size=2)

    return Recorder()


QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False)


def _ours(module_kw=None, **kw):
    module = make_module(TrainModule, **(module_kw or {}))
    kw = {**QUIET, "enable_model_summary": False, **kw}
    trainer = Trainer(accelerator="cpu", devices=1, stall_timeout_s=None, **kw)
    trainer.fit(module)
    return trainer, module


def _lightning(module_kw=None, **kw):
    pl = pytest.importorskip("pytorch_lightning")
    module = make_module(pl.LightningModule, **(module_kw or {}))
    kw = {**QUIET, "enable_model_summary": False, **kw}
    trainer = pl.Trainer(accelerator="cpu", devices=1, **kw)
    trainer.fit(module)
    return trainer, module


def _same_run(module_kw=None, **kw):
    """Both libraries: the same global step, epoch count and batches seen in training and validation."""
    (t1, m1), (t2, m2) = _ours(module_kw, **kw), _lightning(module_kw, **kw)
    assert (t1.global_step, t1.current_epoch) == (t2.global_step, t2.current_epoch)
    assert m1.train_seen == m2.train_seen
    assert m1.val_seen == m2.val_seen
    return (t1, m1), (t2, m2)


@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_fast_dev_run_matches_lightning(fast_dev_run, tmp_path):
    (ours, _), (theirs, _) = _same_run(fast_dev_run=fast_dev_run, max_epochs=5)
    n = int(fast_dev_run)
    assert ours.global_step == n and ours.max_steps == n
    assert ours.loggers == [] and (ours.checkpoint_callback is None) == (theirs.checkpoint_callback is None)


def test_fast_dev_run_suppresses_checkpointing_and_logging(tmp_path):
    ours = Trainer(accelerator="cpu", devices=1, fast_dev_run=True, default_root_dir=str(tmp_path),
                   enable_progress_bar=False,
                   callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"))], stall_timeout_s=None)
    ours.fit(make_module(TrainModule))
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "lightning_logs")
    assert ours.checkpoint_callback.dirpath == str(tmp_path / "ck")  # the callback stays, as Lightning's
    with pytest.raises(ValueError, match=r'You cannot execute `.validate\(ckpt_path="best"\)` with `fast_dev_run=True`'):
        ours.validate(ckpt_path="best")


@pytest.mark.parametrize("steps", [0, 1, 2, -1])
def test_sanity_check_batches_match_lightning(steps):
    (ours, m1), _ = _same_run(num_sanity_val_steps=steps, max_epochs=1)
    assert len(m1.val_seen) == 4 + (4 if steps == -1 else steps)


def test_sanity_check_default_is_two_and_not_logged():
    trainer, module = _ours(max_epochs=1)
    assert trainer.num_sanity_val_steps == 2
    assert module.val_seen[:2] == module.val_seen[2:4]  # the sanity batches, then the epoch's validation

    logged, kept = [], []

    class Recording(Logger):
        def log_metrics(self, metrics, step):
            logged.append(dict(metrics))

    class Kept(Callback):  # on_train_epoch_start runs after the sanity check
        def on_train_epoch_start(self, trainer, module):
            kept.append(dict(trainer.callback_metrics))

    Trainer(accelerator="cpu", devices=1, stall_timeout_s=None, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, logger=Recording(), max_epochs=1, callbacks=Kept()).fit(make_module(TrainModule))
    assert kept == [{}]  # the sanity run's val_loss was not kept ...
    assert sum("val_loss" in m for m in logged) == 1  # ... nor logged: only the epoch's validation


@pytest.mark.parametrize("every", [2, 3])
def test_check_val_every_n_epoch_matches_lightning(every):
    (ours, m1), (_, m2) = _same_run(check_val_every_n_epoch=every, max_epochs=4, num_sanity_val_steps=0,
                                    module_kw=dict(n_train=4, n_val=2))
    assert m1.vals == m2.vals == 4 // every


def test_check_val_every_n_epoch_none_with_steps_matches_lightning():
    _same_run(check_val_every_n_epoch=None, val_check_interval=3, max_epochs=3, num_sanity_val_steps=0,
              module_kw=dict(n_train=4, n_val=2))


@pytest.mark.parametrize("kw", [dict(min_epochs=3), dict(min_steps=11), dict(min_epochs=2, min_steps=5)])
def test_min_epochs_and_steps_override_a_stop_as_lightning(kw):
    """validation asks to stop at its first run (end of epoch 0); training goes on until the minimum."""
    (ours, m1), _ = _same_run(max_epochs=6, num_sanity_val_steps=0, module_kw=dict(n_train=8, stop_at_val=1),
                              **kw)
    assert ours.global_step >= kw.get("min_steps", 0) and ours.current_epoch >= kw.get("min_epochs", 0)
    assert ours.global_step < 24


def test_early_stopping_waits_for_min_epochs_as_lightning():
    pl = pytest.importorskip("pytorch_lightning")
    kw = dict(max_epochs=8, min_epochs=4, num_sanity_val_steps=0, module_kw=dict(n_train=4, n_val=2, lr=0.001))
    es = dict(monitor="val_loss", patience=0, mode="max", check_on_train_epoch_end=False)
    ours, _ = _ours(callbacks=EarlyStopping(**es), **kw)
    theirs, _ = _lightning(callbacks=pl.callbacks.EarlyStopping(**es), **kw)
    assert (ours.global_step, ours.current_epoch) == (theirs.global_step, theirs.current_epoch)
    assert ours.current_epoch == 4  # the loss falls, so "max" asks to stop at the second validation


@pytest.mark.parametrize("max_time", ["00:00:00:00", timedelta(0), {"seconds": 0}])
def test_max_time_adds_a_timer_that_stops_at_the_first_step(max_time):
    trainer, _ = _ours(max_time=max_time, max_epochs=3, num_sanity_val_steps=0)
    timers = [c for c in trainer.callbacks if isinstance(c, Timer)]
    assert len(timers) == 1 and timers[0].interval == "step"
    assert trainer.global_step == 0  # as Lightning: the budget is checked at fit start, before any step


def test_max_time_is_ignored_beside_a_users_timer():
    mine = Timer(duration={"days": 1})
    trainer = Trainer(accelerator="cpu", devices=1, max_time="00:00:00:01", callbacks=[mine], **QUIET)
    assert [c for c in trainer.callbacks if isinstance(c, Timer)] == [mine]


@pytest.mark.parametrize("overfit", [3, 0.25])
def test_overfit_batches_matches_lightning(overfit):
    (ours, m1), _ = _same_run(overfit_batches=overfit, max_epochs=3, num_sanity_val_steps=0,
                              module_kw=dict(shuffle=True))
    n = 3 if overfit == 3 else 2
    assert m1.train_seen == m1.train_seen[:n] * 3  # the same batches every epoch, in order


def _clip_run(lib, algorithm):
    kw = dict(gradient_clip_val=0.05, gradient_clip_algorithm=algorithm, max_steps=2, num_sanity_val_steps=0)
    trainer, module = (_ours if lib == "zt" else _lightning)(**kw)
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_gradient_clip_algorithm_matches_lightning(algorithm):
    ours, theirs = _clip_run("zt", algorithm), _clip_run("pl", algorithm)
    for a, b in zip(ours, theirs):
        # tolerance: exact: one process, Lightning's ops in Lightning's order (bit-equal under ATEN_CPU_CAPABILITY default, avx2, avx512)
        assert torch.equal(a, b)


def test_value_clipping_clamps_every_element():
    module = make_module(TrainModule)
    t = Trainer(accelerator="cpu", devices=1, gradient_clip_val=0.01, gradient_clip_algorithm="value",
                max_steps=1, stall_timeout_s=None, **QUIET)
    before = [p.detach().clone() for p in module.parameters()]
    t.fit(module, DataLoader(_data(2), batch_size=2))  # one step of SGD(lr=0.1): |delta| <= 0.1 * 0.01
    u = torch.finfo(torch.float32).eps / 2
    for b, p in zip(before, module.parameters()):
        delta = (p.detach() - b).abs()
        # tolerance: the step 0.1 x 0.01 rounds 3 times (3u x 0.001), p - step once (u |p|), the difference back once (u x 0.001)
        assert abs(float(delta.max()) - 0.001) <= u * float(b.abs().max()) + 4 * u * 0.001


def test_model_summary_is_added_unless_disabled_or_given():
    assert sum(isinstance(c, ModelSummary) for c in Trainer(accelerator="cpu", **QUIET).callbacks) == 1
    assert not any(isinstance(c, ModelSummary) for c in
                   Trainer(accelerator="cpu", enable_model_summary=False, **QUIET).callbacks)
    mine = ModelSummary(max_depth=2)
    assert [c for c in Trainer(accelerator="cpu", callbacks=mine, **QUIET).callbacks
            if isinstance(c, ModelSummary)] == [mine]


def test_one_callback_is_a_list_of_one():
    mine = Timer()
    assert Trainer(accelerator="cpu", callbacks=mine, enable_model_summary=False, **QUIET).callbacks == [mine]


def test_detect_anomaly_names_the_backward_that_made_a_nan():
    class Bad(TrainModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (torch.sqrt(self.w - 1.0) * 0).sum() + self.w.sum() * 0  # sqrt(-1) backward: nan

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(_data(2), batch_size=2)
    with pytest.raises(RuntimeError, match="SqrtBackward"):
        Trainer(accelerator="cpu", detect_anomaly=True, max_steps=1, on_nonfinite="warn", stall_timeout_s=None,
                **QUIET).fit(Bad(), data)
    assert not torch.is_anomaly_enabled()
    Trainer(accelerator="cpu", max_steps=1, on_nonfinite="warn", stall_timeout_s=None, **QUIET).fit(Bad(), data)


@pytest.mark.parametrize("kw, field", [
    (dict(fast_dev_run=-1), "fast_dev_run"), (dict(num_sanity_val_steps=-2), "num_sanity_val_steps"),
    (dict(check_val_every_n_epoch=0), "check_val_every_n_epoch"), (dict(min_epochs=-1), "min_epochs"),
    (dict(min_steps=1.5), "min_steps"), (dict(overfit_batches=1.5), "overfit_batches"),
    (dict(gradient_clip_algorithm="max"), "gradient_clip_algorithm"), (dict(max_time="1h"), "max_time")])
def test_bad_values_are_refused(kw, field):
    with pytest.raises(ConfigError, match=field):
        Trainer(accelerator="cpu", **kw)


@pytest.mark.parametrize("sized", [True, False])
def test_is_last_batch_as_lightning(sized):
    """``trainer.is_last_batch`` in the training step: by length for a sized loader, one batch ahead
    for an iterable without one, and ``limit_train_batches`` counts; the same under Lightning."""
    pl = pytest.importorskip("pytorch_lightning")

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            return iter([(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)) for _ in range(5)])

    def make(base):
        class M(base):
            def __init__(self):
                super().__init__()
                self.net, self.seen = torch.nn.Linear(4, 1), []

            def training_step(self, batch, batch_idx):
                self.seen.append(self.trainer.is_last_batch)
                x, y = batch
                return torch.nn.functional.mse_loss(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                return DataLoader(_data(10), batch_size=2) if sized else DataLoader(Stream(), batch_size=None)
        return M()

    seen = {}
    for lib, cls, base in (("pl", pl.Trainer, pl.LightningModule), ("zt", Trainer, TrainModule)):
        m = make(base)
        cls(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=4 if sized else None, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(m)
        seen[lib] = m.seen
    assert seen["zt"] == seen["pl"] == ([False] * 3 + [True] if sized else [False] * 4 + [True]) * 2
