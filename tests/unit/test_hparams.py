"""save_hyperparameters / hparams against pytorch-lightning 2.6 on the same module classes (the
collected dict, ignore=, names, a config object, inheritance), what the loggers get and what
the checkpoint stores; load_from_checkpoint on one process from every kind of file."""
from __future__ import annotations

import logging
import os
from argparse import Namespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zerotrain
from zerotrain import CheckpointError, ConfigError, CSVLogger, DataModule, ModelCheckpoint, Trainer, TrainModule
from zerotrain.trainer.checkpoint import directory as checkpoint_io
from zerotrain.trainer.checkpoint.consolidate import consolidate

pl = pytest.importorskip("pytorch_lightning")


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def make_classes(base: type) -> dict[str, type]:
    """The same module classes on Lightning's base or ours: only the base differs."""

    class Net(base):
        def __init__(self, hidden: int = 4, lr: float = 0.1, act: str = "relu", sizes=(3, 5), backbone=None,
                     **extra):
            super().__init__()
            self.save_hyperparameters(ignore=["backbone"])
            self.layer = nn.Linear(3, hidden)
            self.out = nn.Linear(hidden, 1)

        def forward(self, x):
            return self.out(torch.relu(self.layer(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=4)

    class IgnoreOne(base):
        def __init__(self, a, b=2, c="x"):
            super().__init__()
            self.save_hyperparameters(ignore="b")

    class Named(base):
        def __init__(self, a, b=2, c="x"):
            super().__init__()
            self.save_hyperparameters("a", "c", logger=False)

    class Config(base):
        def __init__(self, config, other=3):
            super().__init__()
            self.save_hyperparameters(config)

    class Parent(base):
        def __init__(self, p=1, q="q"):
            super().__init__()
            self.save_hyperparameters()

    class Child(Parent):
        def __init__(self, r, p=5, **kwargs):
            super().__init__(p=p, **kwargs)

    class Empty(base):
        def __init__(self, a=1):
            super().__init__()
            self.save_hyperparameters({})

    return {c.__name__: c for c in (Net, IgnoreOne, Named, Config, Parent, Child, Empty)}


PL, ZT = make_classes(pl.LightningModule), make_classes(TrainModule)

CASES = [("Net", (), {"hidden": 6, "act": "gelu", "backbone": "bb", "extra_kw": 7}),
         ("IgnoreOne", (1,), {"c": "y"}), ("Named", (1, 5), {}),
         ("Config", ({"width": 3, "depth": 2},), {}), ("Config", (Namespace(width=3, depth=2),), {"other": 4}),
         ("Parent", (), {"q": "z"}), ("Child", (9,), {"q": "w"}), ("Empty", (), {})]


@pytest.mark.parametrize("name,args,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_collected_hparams_equal_lightning(name, args, kwargs):
    theirs, ours = PL[name](*args, **kwargs), ZT[name](*args, **kwargs)
    assert dict(ours.hparams) == dict(theirs.hparams)
    assert dict(ours.hparams_initial) == dict(theirs.hparams_initial)
    assert getattr(ours, "_hparams_name", None) == getattr(theirs, "_hparams_name", None)
    assert ours._log_hyperparams == theirs._log_hyperparams
    assert repr(ours.hparams) == repr(theirs.hparams)
    assert type(ours.hparams).__name__ == type(theirs.hparams).__name__ == "AttributeDict"


def test_hparams_are_mutable_and_initial_is_frozen():
    m = ZT["Net"](hidden=6)
    m.hparams.lr = 0.5
    assert m.hparams["lr"] == 0.5 and m.hparams_initial.lr == 0.1
    m.hparams_initial["lr"] = 9  # a copy
    assert m.hparams_initial.lr == 0.1


def test_a_primitive_is_refused_as_lightning():
    class Bad(TrainModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters(3)

    with pytest.raises(ValueError, match="Primitives"):
        Bad()


class _Recorder(zerotrain.loggers.Logger):
    def __init__(self):
        self.params: list[dict] = []

    def log_hyperparams(self, params):
        self.params.append(dict(params))


class _PLRecorder(pl.loggers.Logger):
    name, version = "rec", 0

    def __init__(self):
        super().__init__()
        self.params: list[dict] = []

    def log_hyperparams(self, params, *args, **kwargs):
        self.params.append(dict(params))

    def log_metrics(self, metrics, step=None):
        pass


def _pl_fit(tmp_path, module, datamodule=None):
    rec = _PLRecorder()
    csv = pl.loggers.CSVLogger(str(tmp_path / "pl"))
    trainer = pl.Trainer(max_steps=2, logger=[rec, csv], enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=datamodule)
    trainer.save_checkpoint(str(tmp_path / "pl.ckpt"))
    return rec, csv, torch.load(tmp_path / "pl.ckpt", weights_only=True)


def _zt_fit(tmp_path, module, datamodule=None):
    rec = _Recorder()
    csv = CSVLogger(str(tmp_path / "zt"))
    trainer = Trainer(max_steps=2, logger=[rec, csv], enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)],
                      default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=datamodule)
    _, meta = checkpoint_io.load_meta(tmp_path / "ck")
    return rec, csv, meta


class _DM(DataModule):
    def __init__(self, batch_size: int = 4, hidden: int = 6):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=self.hparams.batch_size)


class _PLDM(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, hidden: int = 6):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=self.hparams.batch_size)


def test_loggers_and_checkpoint_get_lightnings_hparams(tmp_path):
    """The dict each logger's log_hyperparams gets (once per fit, datamodule's merged in), the
    hparams.yaml CSVLogger writes, and the checkpoint's hyper_parameters / hparams_name."""
    kwargs = {"hidden": 6, "sizes": [2, 2], "extra_kw": "e"}
    theirs_rec, theirs_csv, ckpt = _pl_fit(tmp_path, PL["Net"](**kwargs), _PLDM())
    ours_rec, ours_csv, meta = _zt_fit(tmp_path, ZT["Net"](**kwargs), _DM())
    assert ours_rec.params == theirs_rec.params and len(ours_rec.params) == 1
    assert ours_rec.params[0] == {"hidden": 6, "lr": 0.1, "act": "relu", "sizes": [2, 2], "extra_kw": "e",
                                  "batch_size": 4}
    import yaml

    ours_yaml = yaml.safe_load(open(os.path.join(ours_csv.log_dir, "hparams.yaml")))
    theirs_yaml = yaml.unsafe_load(open(os.path.join(theirs_csv.log_dir, "hparams.yaml")))
    assert ours_yaml == theirs_yaml
    assert meta["hyper_parameters"] == dict(ckpt["hyper_parameters"])
    assert meta["hparams_name"] == ckpt["hparams_name"] == "kwargs"
    assert meta["datamodule_hyper_parameters"] == dict(ckpt["datamodule_hyper_parameters"])


def test_clashing_datamodule_hparams_raise_as_lightning(tmp_path):
    with pytest.raises(RuntimeError, match=r"Error while merging hparams: the keys \['hidden'\]"):
        _zt_fit(tmp_path, ZT["Net"](hidden=5), _DM(hidden=6))


def test_logger_false_logs_nothing(tmp_path):
    m = ZT["Named"](1)
    assert m._log_hyperparams is False


# ---------------------------------------------------------------------------- load_from_checkpoint

def _trained(tmp_path, **kwargs):
    torch.manual_seed(0)
    module = ZT["Net"](**kwargs)
    trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)])
    trainer.fit(module)
    return module


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_load_from_checkpoint_rebuilds_from_hparams_and_overrides(tmp_path):
    trained = _trained(tmp_path, hidden=7, act="gelu")
    loaded = ZT["Net"].load_from_checkpoint(str(tmp_path / "ck"))
    assert dict(loaded.hparams) == dict(trained.hparams) and loaded.hparams.hidden == 7
    _same_weights(loaded, trained)
    x = torch.randn(5, 3)
    assert torch.equal(loaded(x), trained(x))
    again = ZT["Net"].load_from_checkpoint(str(tmp_path / "ck" / "latest"), lr=0.5, backbone="b")
    assert again.hparams.lr == 0.5 and again.hparams.hidden == 7 and "backbone" not in again.hparams
    with pytest.raises(RuntimeError, match="size mismatch"):
        ZT["Net"].load_from_checkpoint(str(tmp_path / "ck"), hidden=3)


def test_load_from_consolidated_and_weights_only_files(tmp_path):
    trained = _trained(tmp_path, hidden=5)
    st = consolidate(tmp_path / "ck", tmp_path / "model.safetensors")
    _same_weights(ZT["Net"].load_from_checkpoint(str(st)), trained)  # hparams from the header
    pt = consolidate(tmp_path / "ck", tmp_path / "model.pt")
    with pytest.raises(RuntimeError, match="size mismatch"):  # a torch file carries no hparams: defaults
        ZT["Net"].load_from_checkpoint(str(pt))
    _same_weights(ZT["Net"].load_from_checkpoint(str(pt), hidden=5), trained)
    cb = ModelCheckpoint(dirpath=str(tmp_path / "w"), save_weights_only=True, save_last=True)
    torch.manual_seed(0)
    module = ZT["Net"](hidden=5)
    Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[cb]).fit(module)
    assert cb.last_path.endswith(".safetensors")
    _same_weights(ZT["Net"].load_from_checkpoint(cb.last_path), module)


def test_load_from_a_lightning_style_torch_file(tmp_path):
    trained = ZT["Net"](hidden=3)
    torch.save({"state_dict": trained.state_dict(), "hyper_parameters": {"hidden": 3}}, tmp_path / "m.ckpt")
    _same_weights(ZT["Net"].load_from_checkpoint(str(tmp_path / "m.ckpt")), trained)
    (tmp_path / "m.txt").write_text("x")
    with pytest.raises(ConfigError, match="valid: a checkpoint directory"):
        ZT["Net"].load_from_checkpoint(str(tmp_path / "m.txt"))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ZT["Net"].load_from_checkpoint(str(tmp_path / "nowhere"))


def test_config_object_hparams_load_back_under_their_argument(tmp_path):
    class Cfg(TrainModule):
        def __init__(self, config):
            super().__init__()
            self.save_hyperparameters(config)
            self.lin = nn.Linear(3, config.width)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(_data(), batch_size=4)

    torch.manual_seed(0)
    m = Cfg(Namespace(width=4, depth=2))
    Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)]).fit(m)
    _, meta = checkpoint_io.load_meta(tmp_path / "ck")
    assert meta["hparams_name"] == "config" and meta["hyper_parameters"] == {"width": 4, "depth": 2}
    loaded = Cfg.load_from_checkpoint(str(tmp_path / "ck"))  # Cfg(config=AttributeDict(width=4, depth=2))
    assert loaded.hparams.width == 4 and loaded.hparams.depth == 2
    _same_weights(loaded, m)


def test_on_load_checkpoint_and_configure_model_in_lightnings_order(tmp_path):
    calls = []

    class Hooked(ZT["Net"]):
        def configure_model(self):
            calls.append("configure_model")

        def on_load_checkpoint(self, checkpoint):
            calls.append("on_load_checkpoint")
            assert set(checkpoint["state_dict"]) == {"layer.weight", "layer.bias", "out.weight", "out.bias"}
            assert checkpoint["hyper_parameters"]["hidden"] == 4
            checkpoint["state_dict"]["out.bias"] = torch.full((1,), 7.0)  # the hook may edit the state

    _trained(tmp_path)
    loaded = Hooked.load_from_checkpoint(str(tmp_path / "ck"))
    assert calls == ["configure_model", "on_load_checkpoint"]
    assert float(loaded.out.bias.detach()) == 7.0


def test_an_unloadable_hparam_is_left_out_with_a_warning_naming_it(tmp_path, caplog):
    class Holder(ZT["Net"]):
        def __init__(self, fn=len, hidden=4):
            super().__init__(hidden=hidden)
            self.save_hyperparameters()

    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        m = Holder()
        Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)]).fit(m)
    assert any("hparam 'fn'" in r.message and "not stored in the checkpoint" in r.message for r in caplog.records)
    _, meta = checkpoint_io.load_meta(tmp_path / "ck")
    assert "fn" not in meta["hyper_parameters"] and meta["hyper_parameters"]["hidden"] == 4
    _same_weights(Holder.load_from_checkpoint(str(tmp_path / "ck"), fn=max), m)


# ---------------------------------------------------------------------------- conveniences, presets

def test_module_conveniences_unattached():
    m = ZT["Net"]()
    assert m.device == torch.device("cpu") and m.dtype == torch.float32 and not m.on_gpu
    assert (m.current_epoch, m.global_step, m.local_rank, m.global_rank) == (0, 0, 0, 0)
    m.example_input_array = torch.zeros(2, 3)
    assert m.example_input_array.shape == (2, 3)
    out = m.all_gather({"a": 1, "b": [torch.ones(2)], "c": 2.5})  # one process: unchanged, numbers as tensors
    assert torch.equal(out["a"], torch.tensor(1)) and torch.equal(out["b"][0], torch.ones(2))
    assert out["c"].dtype == torch.float32
    assert m.double().dtype == torch.float64


def test_strategy_classes_are_exported():
    from zerotrain import strategies

    for name in ("DDP", "DDPStrategy", "SingleDevice", "SingleDeviceStrategy", "ZeroStage1", "ZeroStage2",
                 "ZeroStage3", "Offload", "PipelineStrategy", "Strategy"):
        assert getattr(zerotrain, name) is getattr(strategies, name), name
        assert name in zerotrain.__all__
    assert isinstance(Trainer(strategy=zerotrain.ZeroStage2()).strategy, strategies.ZeroStage2)
    for name in ("ZeroSpec", "OffloadPolicy", "PipelineConfig", "PipelineModule", "DDPConfig"):
        assert name in strategies.__all__, name


@pytest.mark.parametrize("preset,device", [("offload_cpu", "cpu"), ("offload_nvme", "nvme")])
def test_offload_presets_by_name_in_python(preset, device):
    trainer = Trainer(strategy=preset, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    assert trainer.strategy.stepper.policy.optimizer_device == device
    class AdamNet(ZT["Net"]):  # NVMe offload swaps Adam state
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    torch.manual_seed(0)
    trainer.fit(AdamNet())
    assert trainer.global_step == 2
