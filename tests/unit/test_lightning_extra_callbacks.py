"""Lightning's smaller callbacks under zerotrain, each beside pytorch-lightning 2.6's:
BackboneFinetuning / BaseFinetuning, GradientAccumulationScheduler, OnExceptionCheckpoint,
DeviceStatsMonitor and the Rich progress bar and model summary."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain
from zerotrain import Trainer, TrainModule
from zerotrain.utilities.exceptions import MisconfigurationException


def _pl():
    return pytest.importorskip("pytorch_lightning")


def _module(base, fail_at=None):
    class M(base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            if fail_at is not None and self.global_step == fail_at:
                raise RuntimeError("boom")
            self.seen_accumulation = getattr(self, "seen_accumulation", [])
            self.seen_accumulation.append(self.trainer.accumulate_grad_batches)
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return DataLoader(TensorDataset(torch.randn(8, 4, generator=g)), batch_size=2)

    return M()


def _fit(lib, callbacks, tmp_path, max_epochs=3, logger=False, enable_progress_bar=False, **module_kw):
    trainer_cls, base = (Trainer, TrainModule) if lib is zerotrain else (lib.Trainer, lib.LightningModule)
    model = _module(base, **module_kw)
    trainer = trainer_cls(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=logger, callbacks=callbacks,
                          enable_checkpointing=False, enable_progress_bar=enable_progress_bar,
                          enable_model_summary=False, default_root_dir=str(tmp_path), log_every_n_steps=1)
    error = None
    try:
        trainer.fit(model)
    except Exception as exc:  # noqa: BLE001 - compared by the tests
        error = exc
    return model, trainer, error


def test_backbone_finetuning_trains_as_lightnings(tmp_path):
    pl = _pl()
    results = []
    for lib in (zerotrain, pl):
        cb = lib.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5,
                                              verbose=True)
        model, trainer, error = _fit(lib, [cb], tmp_path)
        assert error is None
        groups = [(len(g["params"]), g["lr"]) for g in trainer.optimizers[0].param_groups] \
            if lib is pl else [(len(g["params"]), g["lr"]) for g in trainer.optimizer.param_groups]
        results.append((groups, cb.previous_backbone_lr, {k: v.clone() for k, v in model.state_dict().items()},
                        cb.state_dict()["internal_optimizer_metadata"]))
    ours, theirs = results
    # tolerance: exact: one process, Lightning's ops in Lightning's order (bit-equal under ATEN_CPU_CAPABILITY default, avx2, avx512)
    assert ours[0] == theirs[0] and ours[1] == theirs[1] and ours[3] == theirs[3]
    for key in theirs[2]:
        assert torch.equal(ours[2][key], theirs[2][key]), key


def test_backbone_finetuning_needs_a_backbone_and_a_plain_optimizer(tmp_path):
    from zerotrain.callbacks import BackboneFinetuning, BaseFinetuning

    class NoBackbone(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

    with pytest.raises(MisconfigurationException, match="should have a nn.Module `backbone` attribute"):
        BackboneFinetuning().on_fit_start(None, NoBackbone())
    with pytest.raises(NotImplementedError):
        BaseFinetuning().finetune_function(None, 0, None)
    flat = BaseFinetuning.flatten_modules(_module(TrainModule))
    assert [type(m).__name__ for m in flat] == ["Linear", "BatchNorm1d", "Linear"]


def test_gradient_accumulation_scheduler_as_lightnings(tmp_path):
    pl = _pl()
    seen = []
    for lib in (zerotrain, pl):
        cb = lib.callbacks.GradientAccumulationScheduler({1: 2, 2: 4})
        model, trainer, error = _fit(lib, [cb], tmp_path)
        assert error is None
        seen.append((model.seen_accumulation, trainer.global_step, model.head.weight.detach().clone()))
    assert seen[0][:2] == seen[1][:2] == ([1] * 4 + [2] * 4 + [4] * 4, 4 + 2 + 1)
    # tolerance: exact: one process, Lightning's ops in Lightning's order (bit-equal under ATEN_CPU_CAPABILITY default, avx2, avx512)
    assert torch.equal(seen[0][2], seen[1][2])
    with pytest.raises(MisconfigurationException, match="Accumulation factor should be an int greater than 0"):
        zerotrain.callbacks.GradientAccumulationScheduler({0: 0})
    with pytest.raises(TypeError, match="Empty dict"):
        zerotrain.callbacks.GradientAccumulationScheduler({})


def test_on_exception_checkpoint_saves_when_fit_fails(tmp_path):
    from zerotrain.callbacks import OnExceptionCheckpoint

    cb = OnExceptionCheckpoint(tmp_path / "ck")
    _, trainer, error = _fit(zerotrain, [cb], tmp_path, fail_at=3)
    assert str(error) == "boom" and cb.ckpt_path == str(tmp_path / "ck" / "on_exception.ckpt")
    resumed = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    resumed.fit(_module(TrainModule), ckpt_path=cb.ckpt_path)
    assert resumed.global_step == 5
    ok = OnExceptionCheckpoint(tmp_path / "ck")  # a fit that ends well removes it, as Lightning's
    _fit(zerotrain, [ok], tmp_path, max_epochs=1)
    assert not os.path.exists(ok.ckpt_path)
    with pytest.raises(ValueError, match="filename cannot be empty"):
        OnExceptionCheckpoint(tmp_path, filename="")


def test_device_stats_monitor_logs_lightnings_names(tmp_path):
    pl = _pl()
    names = []
    for lib in (zerotrain, pl):
        logger = lib.loggers.CSVLogger(str(tmp_path / lib.__name__))
        _, trainer, error = _fit(lib, [lib.callbacks.DeviceStatsMonitor()], tmp_path, max_epochs=1, logger=logger)
        assert error is None
        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            names.append(f.readline().strip().split(","))
    assert [n for n in names[0] if n.startswith("DeviceStatsMonitor")] == \
        [n for n in names[1] if n.startswith("DeviceStatsMonitor")]
    assert any(n == "DeviceStatsMonitor.on_train_batch_end/cpu_percent" for n in names[0])
    with pytest.raises(MisconfigurationException, match=r"Trainer\(logger=False\)"):
        zerotrain.callbacks.DeviceStatsMonitor().setup(type("T", (), {"loggers": []})(), None, "fit")


def _epoch_tasks(lib, tmp_path):
    """(description, completed, total) of the Rich training task at each epoch's end."""
    seen = []

    class Spy(lib.callbacks.Callback):
        def on_train_epoch_end(self, trainer, module):
            task = trainer.progress_bar_callback.train_progress_bar
            seen.append((task.description, task.completed, task.total))

    bar = lib.callbacks.RichProgressBar(console_kwargs={"force_terminal": False, "width": 120})
    _, _, error = _fit(lib, [bar, Spy()], tmp_path, max_epochs=2, enable_progress_bar=True)
    assert error is None and bar.is_enabled
    return seen


def test_rich_progress_bar_tracks_the_epoch_as_lightnings(tmp_path):
    pl = _pl()
    assert _epoch_tasks(zerotrain, tmp_path / "ours") == _epoch_tasks(pl, tmp_path / "theirs") == \
        [("Epoch 0/1 ", 4, 4), ("Epoch 1/1 ", 4, 4)]
    assert zerotrain.callbacks.RichProgressBar(refresh_rate=0).is_disabled
    theme = pl.callbacks.progress.rich_progress.RichProgressBarTheme()
    assert zerotrain.callbacks.RichProgressBarTheme().__dict__ == theme.__dict__ or \
        zerotrain.callbacks.RichProgressBarTheme().progress_bar == theme.progress_bar


def test_a_progress_bar_with_the_bar_off_is_lightnings_error(tmp_path):
    with pytest.raises(MisconfigurationException, match="configured with `enable_progress_bar=False` but found "
                                                        "`RichProgressBar` in callbacks list"):
        Trainer(callbacks=[zerotrain.callbacks.RichProgressBar()], enable_progress_bar=False)
    with pytest.raises(MisconfigurationException, match="multiple progress bar callbacks"):
        Trainer(callbacks=[zerotrain.callbacks.TQDMProgressBar(), zerotrain.callbacks.TQDMProgressBar()])


def test_rich_needs_rich(monkeypatch):
    from zerotrain.callbacks.progress import rich_progress

    monkeypatch.setattr(rich_progress, "version_at_least", lambda *a: False)
    with pytest.raises(ModuleNotFoundError, match=r"`RichProgressBar` requires `rich` >= 10.2.2"):
        rich_progress.RichProgressBar()
    with pytest.raises(ModuleNotFoundError, match=r"`RichModelSummary` requires `rich`"):
        rich_progress.RichModelSummary()


def test_rich_model_summary_prints_a_table(tmp_path, capsys):
    summary = zerotrain.callbacks.RichModelSummary(max_depth=2)
    _fit(zerotrain, [summary], tmp_path, max_epochs=1)
    out = capsys.readouterr().out
    assert "backbone.0" in out and "Trainable params" in out and "Total params" in out
    assert summary.totals["total"] == 4 * 4 + 4 + 4 * 2 + 4 + 1
