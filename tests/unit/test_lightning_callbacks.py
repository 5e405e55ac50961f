"""Lightning's callbacks under their names: EarlyStopping stops at Lightning's step for the same
logged sequence (pytorch-lightning 2.6 runs the same module in the same test), ModelCheckpoint's
Lightning arguments, Timer and ModelSummary."""
from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import CheckpointError, ConfigError, Trainer, TrainModule
from zerotrain.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, Timer


def _data(n=4):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 2, generator=g), torch.randn(n, 1, generator=g))


def make_module(base, seq):
    """One module for both libraries: validation logs ``val_metric`` = the next value of ``seq``."""

    class Seq(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)
            self.calls = 0

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_metric", seq[min(self.calls, len(seq) - 1)])
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_metric", float(seq[min(self.calls, len(seq) - 1)]))
            self.calls += 1

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=2)

        def val_dataloader(self):
            return DataLoader(_data(2), batch_size=2)

    return Seq()


def _ours(seq, **es):
    cb = EarlyStopping(monitor="val_metric", check_on_train_epoch_end=False, **es)
    module = make_module(TrainModule, seq)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=len(seq) + 2, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, callbacks=[cb],
                              stall_timeout_s=None, num_sanity_val_steps=0, enable_model_summary=False)
    trainer.fit(module)
    return trainer.global_step, module.calls, cb.wait_count, cb.best_score


def _lightning(seq, **es):
    pl = pytest.importorskip("pytorch_lightning")
    cb = pl.callbacks.EarlyStopping(monitor="val_metric", check_on_train_epoch_end=False, **es)
    module = make_module(pl.LightningModule, seq)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=len(seq) + 2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(module)
    return trainer.global_step, module.calls, cb.wait_count, float(cb.best_score)


SEQUENCES = {
    "patience": ([1.0, 0.9, 0.95, 0.93, 0.92, 0.91, 0.5], dict(patience=3)),
    "min_delta": ([1.0, 0.95, 0.9, 0.89, 0.88, 0.87, 0.86], dict(patience=2, min_delta=0.05)),
    "max": ([0.1, 0.2, 0.2, 0.3, 0.25, 0.29, 0.28], dict(mode="max", patience=2)),
    "threshold": ([1.0, 0.8, 0.6, 0.4, 0.2], dict(stopping_threshold=0.5)),
    "divergence": ([1.0, 0.8, 3.0, 0.4], dict(divergence_threshold=2.0)),
    "nan": ([1.0, 0.8, float("nan"), 0.4], dict()),
    "never": ([1.0, 0.9, 0.8], dict(patience=1)),
}


@pytest.mark.parametrize("case", SEQUENCES)
def test_early_stopping_stops_at_lightnings_step(case):
    seq, es = SEQUENCES[case]
    want = _lightning(seq, **es)
    got = _ours(seq, **es)
    assert got[:3] == want[:3], (got, want)  # global_step at the stop, validations run, wait_count
    assert got[3] == pytest.approx(want[3])


def test_early_stopping_default_check_point_follows_lightning():
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, stall_timeout_s=None)
    every_epoch, after_each_val = EarlyStopping("m"), EarlyStopping("m")
    every_epoch.setup(trainer, None)
    trainer.val_check_interval = 5
    after_each_val.setup(trainer, None)
    assert every_epoch._check_on_train_epoch_end and not after_each_val._check_on_train_epoch_end


def test_early_stopping_strict_and_state():
    cb = EarlyStopping("missing")
    with pytest.raises(RuntimeError, match="metric `missing` which is not available.*`x`"):
        cb._run_early_stopping_check(type("T", (), {"callback_metrics": {"x": 1.0}})())
    cb = EarlyStopping("m", patience=2)
    cb.evaluate(1.0), cb.evaluate(2.0)
    again = EarlyStopping("m", patience=2)
    again.load_state_dict(cb.state_dict())
    assert (again.best_score, again.wait_count) == (1.0, 1)
    with pytest.raises(ValueError, match="`mode` can be min, max, got median"):
        EarlyStopping("m", mode="median")


class Tiny(TrainModule):
    def __init__(self, n=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        self.n = n

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", 1.0 / (self.global_step + 1))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(_data(self.n), batch_size=2)


def _fit(tmp_path, callbacks, **kw):
    kw = {"max_steps": 8, **kw}
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                              callbacks=callbacks, default_root_dir=str(tmp_path), stall_timeout_s=None, **kw)
    trainer.fit(Tiny())
    return trainer


def test_model_checkpoint_filename_template_and_top_k(tmp_path):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, monitor="val_loss",
                         save_top_k=2, filename="{epoch}-{step}-{val_loss:.2f}", save_last=False)
    _fit(tmp_path, [cb])
    names = sorted(os.path.basename(p) for p in cb.best_k_models)
    assert names == ["epoch=1-step=6-val_loss=0.17.ckpt", "epoch=1-step=8-val_loss=0.12.ckpt"], names
    assert os.path.basename(cb.best_model_path) == "epoch=1-step=8-val_loss=0.12.ckpt"
    assert cb.best_model_score == pytest.approx(1 / 8)
    assert os.path.basename(cb.kth_best_model_path) == "epoch=1-step=6-val_loss=0.17.ckpt"
    on_disk = sorted(d for d in os.listdir(tmp_path / "ck") if d.startswith("epoch="))
    assert on_disk == names


def test_model_checkpoint_every_n_epochs_and_lightning_default_trigger(tmp_path):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_epochs=2, save_last=False, save_top_k=-1,
                         filename="{step}")
    _fit(tmp_path, [cb], max_steps=-1, max_epochs=4)  # 4 batches of 2 per epoch
    assert sorted(os.path.basename(p) for p in os.listdir(tmp_path / "ck") if p.startswith("step=")) == [
        "step=16.ckpt", "step=8.ckpt"]
    assert ModelCheckpoint(monitor="val_loss").every_n_epochs == 1  # Lightning's trigger when none is given
    assert ModelCheckpoint().every_n_epochs == 1  # no monitor either: Lightning's save every epoch


def test_model_checkpoint_weights_only_is_one_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, monitor="val_loss", save_top_k=1,
                         save_weights_only=True, filename="{step}", save_last=False)
    trainer = _fit(tmp_path, [cb])
    assert sorted(os.listdir(tmp_path / "ck")) == ["step=8.safetensors"]  # the worse one pruned, no scratch
    state = load_file(cb.best_model_path)
    want = {k: v for k, v in trainer.module.state_dict().items()}
    assert set(state) == set(want)
    for k in want:
        torch.testing.assert_close(state[k], want[k])


def test_a_failed_weights_only_consolidation_is_a_checkpoint_error_after_the_scratch_is_removed(tmp_path,
                                                                                                  monkeypatch):
    """The consolidation runs on rank 0 alone; its failure is broadcast, so that every rank raises
    it (here one process: the error surfaces through fit, and nothing is left in dirpath)."""
    from zerotrain.trainer.checkpoint import consolidate

    def full_disk(ckpt, out, **kwargs):
        raise CheckpointError(f"writing {out}.partial (consolidate OUT={str(out)!r}) failed: No space left on device")

    monkeypatch.setattr(consolidate, "consolidate", full_disk)
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, save_weights_only=True,
                         filename="{step}", save_last=False)
    with pytest.raises(CheckpointError, match=r"saving weights .*step=4\.safetensors' failed: rank 0: .*No space left"):
        _fit(tmp_path, [cb])
    assert os.listdir(tmp_path / "ck") == []  # the scratch shards were removed


def test_model_checkpoint_defaults_are_lightnings():
    cb = ModelCheckpoint()
    assert (cb.filename, cb.save_last, cb.every_n_train_steps, cb.every_n_epochs, cb.save_top_k) == (
        None, None, 0, 1, 1)
    assert cb.format_checkpoint_name({}, epoch=1, step=12) == "epoch=1-step=12.ckpt"


def test_model_checkpoint_takes_every_lightning_argument_in_lightnings_order():
    """Each of Lightning's parameters exists here, in its position (ported code may pass them
    positionally); the ones not implemented are a ConfigError naming the argument and why."""
    import inspect

    pl = pytest.importorskip("pytorch_lightning")
    theirs = list(inspect.signature(pl.callbacks.ModelCheckpoint.__init__).parameters)
    assert list(inspect.signature(ModelCheckpoint.__init__).parameters)[:len(theirs)] == theirs
    ModelCheckpoint(dirpath=None, filename=None, monitor=None, verbose=False, save_last=None, save_top_k=1,
                    save_on_exception=False, save_weights_only=False, mode="min", auto_insert_metric_name=True,
                    every_n_train_steps=None, train_time_interval=None, every_n_epochs=None,
                    save_on_train_epoch_end=None, enable_version_counter=True)  # Lightning's defaults
    from datetime import timedelta

    assert ModelCheckpoint(train_time_interval=timedelta(minutes=5)).train_time_interval == timedelta(minutes=5)
    ModelCheckpoint(save_on_exception=True, save_last="link", every_n_train_steps=0)  # implemented


def test_model_checkpoint_auto_insert_metric_name():
    name = "{epoch}-{val_loss:.2f}"
    assert ModelCheckpoint(filename=name).format_checkpoint_name({"val_loss": 0.5}, epoch=3, step=7) == "epoch=3-val_loss=0.50.ckpt"
    assert ModelCheckpoint(filename=name, auto_insert_metric_name=False).format_checkpoint_name(
        {"val_loss": 0.5}, epoch=3, step=7) == "3-0.50.ckpt"


def test_model_checkpoint_verbose_and_its_differences_are_said(tmp_path, caplog):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=4, monitor="val_loss", verbose=True,
                         filename="{step}")
    with caplog.at_level(logging.INFO, logger="zerotrain"):
        _fit(tmp_path, [cb])
        _fit(tmp_path / "quiet", [ModelCheckpoint(dirpath=str(tmp_path / "none"))])
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    saved = [m for _, m in said if "saving model to" in m]
    assert saved == [f"Epoch 0, global step 4: 'val_loss' reached 0.25000 (best 0.25000), saving model to "
                     f"{str(tmp_path / 'ck' / 'step=4.ckpt')!r} as top 1",
                     f"Epoch 1, global step 8: 'val_loss' reached 0.12500 (best 0.12500), saving model to "
                     f"{str(tmp_path / 'ck' / 'step=8.ckpt')!r} as top 1"]
    notes = [(level, m) for level, m in said if "differs from Lightning's" in m]
    assert len(notes) == 2 and {n[0] for n in notes} == {logging.INFO}
    assert "a folder NAME.ckpt (one shard file per rank) under a sharded strategy" in notes[0][1]


def _saving_module(base):
    """Four training batches and one validation batch per epoch; logs ``val_loss``."""

    class Saving(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(_data(8), batch_size=2)

        def val_dataloader(self):
            return DataLoader(_data(2), batch_size=2)

    return Saving()


def _saved_names(lib, root, runs=1, **checkpoint):
    """The checkpoint names (``.ckpt`` dropped) after ``runs`` fits into one directory."""
    pl = pytest.importorskip("pytorch_lightning") if lib == "pl" else None
    common = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, max_epochs=2, val_check_interval=2, default_root_dir=str(root))
    kw = dict(dirpath=str(root / "ck"), monitor="val_loss", save_top_k=-1, filename="{step}", save_last=False,
              **checkpoint)
    for _ in range(runs):
        if lib == "pl":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = pl.Trainer(callbacks=[pl.callbacks.ModelCheckpoint(**kw)], **common)
                trainer.fit(_saving_module(pl.LightningModule))
        else:
            Trainer(callbacks=[ModelCheckpoint(**kw)], stall_timeout_s=None, **common).fit(_saving_module(TrainModule))
    return sorted(n.removesuffix(".ckpt") for n in os.listdir(root / "ck") if n.startswith("step="))


@pytest.mark.parametrize("at_epoch_end", [None, True, False])
def test_model_checkpoint_save_on_train_epoch_end_as_lightning(tmp_path, at_epoch_end):
    """Validation twice per epoch: None (Lightning's rule) and False save after each validation,
    True at the epoch's end only - the same checkpoints as Lightning's."""
    ours = _saved_names("zt", tmp_path / "zt", save_on_train_epoch_end=at_epoch_end)
    assert ours == _saved_names("pl", tmp_path / "pl", save_on_train_epoch_end=at_epoch_end)
    assert ours == (["step=4", "step=8"] if at_epoch_end else ["step=2", "step=4", "step=6", "step=8"])


@pytest.mark.parametrize("counter", [True, False])
def test_model_checkpoint_version_counter_as_lightning(tmp_path, counter):
    """A second fit into the same directory: ``-v1`` names (the default), or the same names
    written again (``enable_version_counter=False``) - as Lightning."""
    ours = _saved_names("zt", tmp_path / "zt", runs=2, enable_version_counter=counter, save_on_train_epoch_end=True)
    assert ours == _saved_names("pl", tmp_path / "pl", runs=2, enable_version_counter=counter,
                                save_on_train_epoch_end=True)
    assert ours == (["step=4", "step=4-v1", "step=8", "step=8-v1"] if counter else ["step=4", "step=8"])


def test_timer_stops_training_when_the_duration_passes(tmp_path):
    timer = Timer(duration={"seconds": 0})
    trainer = _fit(tmp_path, [timer], max_steps=50)
    assert trainer.global_step == 0  # checked at fit start too, as Lightning: no budget, no step
    assert timer.time_remaining() <= 0
    assert Timer("00:01:30:00")._duration == 5400  # seconds, as Lightning's
    with pytest.raises(ValueError, match="duration='90 minutes'"):
        Timer("90 minutes")
    resumed = Timer()
    resumed.load_state_dict({"time_elapsed": {"train": 12.5}})
    assert resumed.time_elapsed() == 12.5


def test_model_summary_counts_parameters_and_bytes_per_rank(tmp_path):
    summary = ModelSummary(max_depth=2)
    _fit(tmp_path, [summary], max_steps=1)
    assert summary.rows == [("net", "Sequential", 13), ("net.0", "Linear", 9), ("net.1", "Linear", 4)]
    assert summary.totals == {"trainable": 13, "frozen": 0, "total": 13}
    assert summary.bytes_per_rank["params"] == 13 * 4
    assert summary.bytes_per_rank["optimizer"] == 0  # plain SGD keeps no state
    assert "13 total params" in summary.table()

