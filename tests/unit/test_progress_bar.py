"""TQDMProgressBar with Lightning's arguments and public attributes; one fit with both libraries
shows the same per-epoch bar (description, total, position) and the same formatted numbers."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import ProgressBar, TQDMProgressBar
from zerotrain.callbacks.progress import Tqdm


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):
    monkeypatch.delenv("TQDM_MINITERS", raising=False)
    monkeypatch.delenv("COLAB_GPU", raising=False)
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread left behind


def _module(base):
    class M(base):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("shown", 1.5, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val", 0.5)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(6, 2)), batch_size=2)

    return M()


def _bar_after_fit(trainer_cls, base, bar):
    trainer = trainer_cls(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                          enable_model_summary=False, num_sanity_val_steps=0, callbacks=[bar])
    trainer.fit(_module(base))
    train = bar.train_progress_bar
    return (train.desc, train.n, train.total, train.pos, bar.val_progress_bar.desc.split(" DataLoader")[0],
            dict(train.postfix and [kv.split("=") for kv in train.postfix.split(", ")]))


def test_tqdm_progress_bar_takes_lightnings_arguments_and_attributes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bar = TQDMProgressBar(refresh_rate=3, process_position=1, leave=True)
    assert (bar.refresh_rate, bar.process_position, bar.is_enabled, bar.is_disabled) == (3, 1, True, False)
    bar.disable()
    assert (bar.is_enabled, bar.is_disabled) == (False, True)
    bar.enable()
    assert TQDMProgressBar(refresh_rate=0).is_disabled
    with pytest.raises(TypeError, match="_train_progress_bar` reference has not been set yet"):
        bar.train_progress_bar
    assert isinstance(bar, ProgressBar) and TQDMProgressBar is not ProgressBar
    with pytest.raises(NotImplementedError):
        ProgressBar().disable()
    monkeypatch.setenv("TQDM_MINITERS", "5")
    assert TQDMProgressBar(refresh_rate=2).refresh_rate == 5
    pickle.dumps(bar)


def test_tqdm_progress_bar_shows_lightnings_epoch_bar(tmp_path, monkeypatch):
    pl = pytest.importorskip("pytorch_lightning")
    monkeypatch.chdir(tmp_path)
    ours = _bar_after_fit(Trainer, TrainModule, TQDMProgressBar(refresh_rate=2))
    theirs = _bar_after_fit(pl.Trainer, pl.LightningModule, pl.callbacks.TQDMProgressBar(refresh_rate=2))
    assert ours == theirs == ("Epoch 1: ", 5, 5, 0, "Validation", {"shown": "1.500"})


@pytest.mark.parametrize("value", [1, 1.5, 10.0, "abc", "1", 1e-9, 123456789, "1.5"])
def test_tqdm_format_num_is_lightnings(value):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm as LTqdm

    assert Tqdm.format_num(value) == LTqdm.format_num(value)


def test_module_print_goes_through_the_bar(tmp_path, capsys):
    class Printing(type(_module(TrainModule))):
        def training_step(self, batch, batch_idx):
            self.print("hello", batch_idx)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(Printing())
    assert "hello 0" in capsys.readouterr().out


def test_module_print_reaches_tqdm_write_as_lightnings(tmp_path, monkeypatch):
    """self.print(..., file=sys.stderr) too goes through the bar's tqdm.write, with its keywords."""
    import sys
    from unittest import mock

    pl = pytest.importorskip("pytorch_lightning")
    monkeypatch.chdir(tmp_path)
    calls = []
    for trainer_cls, base, bar in ((Trainer, TrainModule, TQDMProgressBar),
                                   (pl.Trainer, pl.LightningModule, pl.callbacks.TQDMProgressBar)):
        class Printing(type(_module(base))):
            def training_step(self, batch, batch_idx):
                self.print("training_step", end="")
                return super().training_step(batch, batch_idx)

            def validation_step(self, batch, batch_idx):
                self.print("validation_step", file=sys.stderr)

        with mock.patch("tqdm.tqdm.write") as write:
            trainer_cls(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        val_check_interval=1, callbacks=[bar()]).fit(Printing())
        calls.append(write.call_args_list)
    assert calls[0] == calls[1] == [mock.call("training_step", end=""),
                                    mock.call("validation_step", file=sys.stderr)]


def test_v_num_is_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks.progress.progress_bar import get_standard_metrics

    from zerotrain.callbacks.progress import standard_metrics

    class Lg:
        def __init__(self, version):
            self.version = version

    for versions in ([], [3], ["abcdefgh"], [1, 2], [1, 1], [""], ["x", 5]):
        trainer = type("T", (), {"loggers": [Lg(v) for v in versions]})()
        assert standard_metrics(trainer) == get_standard_metrics(trainer), versions
    assert pl is not None
