"""Lightning's public surface under zerotrain's names: the deeper import paths, the demos (the same
models and data as ``lightning.pytorch.demos`` for the same seed), MisconfigurationException,
is_overridden, DataModule.from_datasets and the module's freeze / unfreeze / export / prepare_data."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain
from zerotrain import ConfigError, DataModule, Trainer, TrainModule
from zerotrain.trainer.errors import MisconfigurationException

PKG_PARENT = str(pathlib.Path(zerotrain.__file__).parent.parent)

#: Lightning's paths after ``lightning.pytorch.``, with a name each must give
PATHS = {"core.module": "TrainModule", "core.datamodule": "DataModule", "demos": "BoringModel",
         "demos.boring_classes": "RandomDataset", "loggers.logger": "DummyLogger", "loggers.csv_logs": "CSVLogger",
         "loggers.tensorboard": "TensorBoardLogger", "utilities.exceptions": "MisconfigurationException",
         "utilities.imports": "_RICH_AVAILABLE", "utilities.model_helpers": "is_overridden",
         "utilities.rank_zero": "rank_zero_only", "utilities.seed": "isolate_rng",
         "utilities.parsing": "AttributeDict", "utilities": "AttributeDict", "callbacks.callback": "Callback",
         "callbacks.model_checkpoint": "ModelCheckpoint", "callbacks.lr_monitor": "LearningRateMonitor",
         "callbacks.progress.tqdm_progress": "Tqdm", "callbacks.progress.progress_bar": "ProgressBar",
         "callbacks.model_summary": "ModelSummary", "callbacks.early_stopping": "EarlyStopping",
         "callbacks.progress": "RichProgressBar", "callbacks.progress.rich_progress": "RichProgressBarTheme",
         "callbacks.lambda_function": "LambdaCallback", "callbacks.finetuning": "BackboneFinetuning",
         "core.optimizer": "LightningOptimizer", "core.saving": "load_hparams_from_yaml"}


def test_lightnings_deeper_paths_import_in_a_fresh_interpreter():
    code = "".join(f"from zerotrain.{path} import {name}\nimport zerotrain.{path}\n" for path, name in PATHS.items())
    code += "import zerotrain\nassert zerotrain.core.module.TrainModule is zerotrain.TrainModule\nprint('ok')\n"
    env = {**os.environ, "PYTHONPATH": PKG_PARENT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_lightnings_paths_name_the_same_things():
    pytest.importorskip("pytorch_lightning")
    import importlib

    for path, name in PATHS.items():
        ours = importlib.import_module(f"zerotrain.{path}")
        theirs = importlib.import_module(f"pytorch_lightning.{path}")
        assert hasattr(ours, name) and (hasattr(theirs, name) or name in ("TrainModule", "DataModule")), path


def test_config_error_is_a_misconfiguration_exception():
    from zerotrain.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException):
        Trainer(max_epochs=-5)
    assert issubclass(ConfigError, ValueError)


def test_demos_build_lightnings_models_and_data_for_the_same_seed():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos import boring_classes as theirs

    from zerotrain.demos import boring_classes as ours

    def build(lib, dm_cls):
        torch.manual_seed(3)
        model, demo = lib.BoringModel(), lib.DemoModel(out_dim=4)
        dm = getattr(lib, dm_cls)()
        dm.setup("fit")
        data = [torch.stack([d[i] for i in range(3)]) for d in (dm.random_train, dm.random_val)]
        extra = [lib.RandomDictDataset(4, 2)[1]["b"], lib.RandomIterableDatasetWithLen(3, 2).__len__()]
        opt, sched = model.configure_optimizers()
        return (model.state_dict(), demo.state_dict(), data, extra, type(opt[0]), opt[0].defaults["lr"],
                type(sched[0]), len(model.train_dataloader()), torch.rand(1))

    a, b = build(ours, "BoringDataModule"), build(theirs, "BoringDataModule")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0) if not isinstance(x, type) else None
    assert a[4:8] == b[4:8]
    torch.manual_seed(0)
    pred = ours.BoringModel()(torch.ones(1, 32))
    torch.manual_seed(0)
    assert torch.equal(pred, theirs.BoringModel()(torch.ones(1, 32)))
    assert pl is not None


def test_boring_model_trains_as_lightnings(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as Theirs

    from zerotrain.demos import BoringModel as Ours

    def run(trainer_cls, model_cls):
        torch.manual_seed(0)
        model = model_cls()
        trainer_cls(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=4, limit_val_batches=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path)).fit(model)
        return model.layer.weight.detach()

    # tolerance: exact: one process, Lightning's ops in Lightning's order (bit-equal under ATEN_CPU_CAPABILITY default, avx2, avx512)
    assert torch.equal(run(Trainer, Ours), run(pl.Trainer, Theirs))


def test_is_overridden_as_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.utilities.model_helpers import is_overridden as theirs

    from zerotrain.demos import BoringDataModule, BoringModel
    from zerotrain.utilities import is_overridden

    from pytorch_lightning.demos import boring_classes as lb

    for name in ("training_step", "validation_step", "on_fit_start", "configure_model"):
        assert is_overridden(name, BoringModel()) == theirs(name, lb.BoringModel())
    for name in ("setup", "prepare_data", "train_dataloader", "teardown"):
        assert is_overridden(name, BoringDataModule()) == theirs(name, lb.BoringDataModule())
    assert is_overridden("x", None) is False
    with pytest.raises(ValueError, match="Expected a parent"):
        is_overridden("forward", torch.nn.Linear(1, 1))
    assert pl is not None


def test_from_datasets_as_lightnings():
    train, val = TensorDataset(torch.arange(6.0)), TensorDataset(torch.arange(4.0))

    class WithBatch(DataModule):
        def __init__(self, batch_size=1, other=0):
            super().__init__()
            self.batch_size, self.other = batch_size, other

    dm = WithBatch.from_datasets(train, {"a": val, "b": val}, batch_size=2, num_workers=0, other=5)
    assert (dm.batch_size, dm.other) == (2, 5)
    loader = dm.train_dataloader()
    assert isinstance(loader, DataLoader) and loader.batch_size == 2
    assert type(loader.sampler).__name__ == "RandomSampler"
    vals = dm.val_dataloader()
    assert set(vals) == {"a", "b"} and type(vals["a"].sampler).__name__ == "SequentialSampler"
    with pytest.raises(MisconfigurationException, match="`test_dataloader` must be implemented"):  # as Lightning
        dm.test_dataloader()


def test_freeze_unfreeze_and_torchscript(tmp_path):
    from zerotrain.demos import BoringModel

    model = BoringModel()
    assert model.freeze() is model and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    model.unfreeze()
    assert model.training and all(p.requires_grad for p in model.parameters())
    model.example_input_array = torch.randn(2, 32)
    traced = model.to_torchscript(tmp_path / "m.pt", method="trace")
    assert model.training  # mode put back
    torch.testing.assert_close(torch.jit.load(tmp_path / "m.pt")(torch.ones(1, 32)), model(torch.ones(1, 32)))
    assert traced is not None
    scripted = model.to_torchscript()
    torch.testing.assert_close(scripted(torch.ones(1, 32)), model(torch.ones(1, 32)))
    with pytest.raises(ValueError, match="only supports 'script' or 'trace'"):
        model.to_torchscript(method="export")


def test_to_onnx_needs_onnx_and_an_input(tmp_path, monkeypatch):
    from zerotrain.demos import BoringModel
    from zerotrain.trainer.api import module_tools

    model = BoringModel()
    monkeypatch.setattr(module_tools, "package_available", lambda name: False)
    with pytest.raises(ModuleNotFoundError, match=r"BoringModel.to_onnx\(\)` requires `onnx`"):
        model.to_onnx(tmp_path / "m.onnx")
    monkeypatch.setattr(module_tools, "package_available", lambda name: True)
    with pytest.raises(ValueError, match="neither `input_sample` nor `model.example_input_array`"):
        model.to_onnx(tmp_path / "m.onnx")


def test_module_prepare_data_runs_before_setup(tmp_path):
    calls = []

    class M(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

        def prepare_data(self):
            calls.append("prepare_data")

        def setup(self, stage):
            calls.append(f"setup:{stage}")

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.ones(2, 1)))

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    module = M()
    trainer.fit(module)
    trainer.predict(module, DataLoader(TensorDataset(torch.ones(2, 1))))
    assert calls == ["prepare_data", "setup:fit", "prepare_data", "setup:predict"]


def test_lambda_callback_calls_the_functions_given(tmp_path):
    from zerotrain.callbacks import LambdaCallback
    from zerotrain.demos import BoringModel

    calls = []
    cb = LambdaCallback(on_fit_start=lambda trainer, module: calls.append("fit_start"),
                        on_train_epoch_end=lambda trainer, module: calls.append(f"epoch_end:{trainer.current_epoch}"))
    Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
            default_root_dir=str(tmp_path)).fit(BoringModel())
    assert calls == ["fit_start", "epoch_end:0", "epoch_end:1"]
    with pytest.raises(TypeError, match="unknown hook"):
        LambdaCallback(on_everything=print)


@pytest.mark.parametrize("kw, seq", [({"patience": 2}, [1.0, 1.0, 1.0]), ({"stopping_threshold": 0.5}, [1.0, 0.4]),
                                     ({"divergence_threshold": 5.0}, [1.0, 6.0]), ({}, [1.0, float("nan")]),
                                     ({"patience": 5}, [3.0, 2.0])])
def test_early_stopping_reason_is_lightnings(kw, seq):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks.early_stopping import EarlyStoppingReason as Theirs

    from zerotrain.callbacks import EarlyStopping
    from zerotrain.callbacks.early_stopping import EarlyStoppingReason

    ours, theirs = EarlyStopping("m", **kw), pl.callbacks.EarlyStopping("m", **kw)
    for value in seq:
        ours.evaluate(value)
        theirs._evaluate_stopping_criteria(torch.tensor(value))
        if theirs.stopping_reason != Theirs.NOT_STOPPED:
            break
    assert ours.stopping_reason.name == theirs.stopping_reason.name
    assert isinstance(ours.stopping_reason, EarlyStoppingReason)
    restored = EarlyStopping("m", **kw)
    restored.load_state_dict(ours.state_dict())
    assert restored.stopping_reason is ours.stopping_reason


def test_hparams_yaml_round_trips_with_lightnings(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.core import saving as theirs

    from zerotrain.core.saving import load_hparams_from_yaml, save_hparams_to_yaml

    hparams = {"lr": 0.1, "layers": [1, 2], "name": "x", "nested": {"a": 1}}
    save_hparams_to_yaml(tmp_path / "ours.yaml", hparams)
    theirs.save_hparams_to_yaml(tmp_path / "theirs.yaml", hparams)
    assert (tmp_path / "ours.yaml").read_text() == (tmp_path / "theirs.yaml").read_text()
    assert load_hparams_from_yaml(tmp_path / "theirs.yaml", use_omegaconf=False) == hparams
    assert theirs.load_hparams_from_yaml(tmp_path / "ours.yaml", use_omegaconf=False) == hparams
    with pytest.warns(UserWarning, match="Missing Tags"):
        assert load_hparams_from_yaml(tmp_path / "none.yaml") == {}
    with pytest.raises(RuntimeError, match="Missing folder"):
        save_hparams_to_yaml(tmp_path / "no" / "h.yaml", hparams)
    assert pl is not None


def test_manual_optimizers_are_lightning_optimizers(tmp_path):
    from zerotrain.core.optimizer import LightningOptimizer
    from zerotrain.demos import ManualOptimBoringModel

    seen = []

    class Model(ManualOptimBoringModel):
        def training_step(self, batch, batch_idx):
            seen.append(isinstance(self.optimizers(), LightningOptimizer))
            return super().training_step(batch, batch_idx)

    Trainer(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path)).fit(Model())
    assert seen == [True, True]
