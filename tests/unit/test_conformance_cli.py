"""What Lightning's own CLI tests (tests_pytorch/test_cli.py) need of the rest of zerotrain (issue
41/44): a module the CLI built saves the parsed config as its hyperparameters and
``load_from_checkpoint`` rebuilds it from them (injected objects included) through the one trusted
instantiator; LightningCLI's ``_class_path`` is neither logged nor a merge clash; the Trainer
methods take Lightning's ``weights_only``; ``--trainer.callbacks`` takes one callback as Lightning's
annotation does; callbacks in ``trainer_defaults`` given as class_path configs are built."""
from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
import yaml

from zerotrain import Trainer
from zerotrain.callbacks import LearningRateMonitor, ModelCheckpoint
from zerotrain.cli import LightningCLI
from zerotrain.demos.boring_classes import BoringDataModule, BoringModel


@pytest.fixture(autouse=True)
def _cli_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["any.py"])
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them; restored after
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)


class Injected(BoringModel):
    def __init__(self, activation: torch.nn.Module = None, width: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.activation = activation
        self.layer = torch.nn.Linear(32, width)


class InjectedData(BoringDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()


_TRAINER = ["--trainer.max_steps=1", "--trainer.max_epochs=1", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_a_cli_built_module_reloads_with_its_injected_objects(tmp_path):
    activation = {"class_path": "torch.nn.LeakyReLU", "init_args": {"negative_slope": 0.25}}
    cli = LightningCLI(Injected, run=False, args=[f"--model.activation={activation}", "--model.width=3", *_TRAINER])
    assert cli.model.hparams["_instantiator"] == "zerotrain.cli.instantiate_module"
    assert cli.model.hparams["activation"]["class_path"] == "torch.nn.LeakyReLU"  # the config, not the nn.Module
    assert cli.model.hparams["activation"]["init_args"]["negative_slope"] == 0.25
    cli.trainer.fit(cli.model)
    path = str(tmp_path / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    model = Injected.load_from_checkpoint(path)
    assert isinstance(model.activation, torch.nn.LeakyReLU) and model.activation.negative_slope == 0.25
    assert model.layer.out_features == 3
    torch.testing.assert_close(model.layer.weight, cli.model.layer.weight)


def test_subclass_mode_reloads_through_the_base_class_and_class_path_is_not_logged(tmp_path):
    cli = LightningCLI(BoringModel, BoringDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       args=[f"--model={__name__}.Injected", "--model.width=5", f"--data={__name__}.InjectedData",
                             *_TRAINER])
    assert cli.model.hparams["_class_path"] == f"{__name__}.Injected"
    assert cli.datamodule.hparams["_class_path"] == f"{__name__}.InjectedData"
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # two different _class_path: no merge clash
    logged = yaml.safe_load(open(os.path.join(cli.trainer.log_dir, "hparams.yaml")))
    assert "_class_path" not in logged and logged["width"] == 5 and logged["batch_size"] == 4
    path = str(tmp_path / "m.ckpt")
    cli.trainer.save_checkpoint(path)
    from zerotrain import TrainModule

    model = TrainModule.load_from_checkpoint(path)
    assert type(model) is Injected and model.layer.out_features == 5


def test_an_untrusted_instantiator_in_a_checkpoint_is_refused(tmp_path):
    model = Injected(width=2)
    path = str(tmp_path / "m.ckpt")
    trainer = Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model)
    model.hparams["_instantiator"] = "os.system"
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError, match="trusted instantiators"):
        Injected.load_from_checkpoint(path)


@pytest.mark.parametrize("method", ["fit", "validate", "test", "predict"])
def test_trainer_methods_take_lightnings_weights_only(method):
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning

    ours = inspect.signature(getattr(Trainer, method)).parameters
    theirs = inspect.signature(getattr(pytorch_lightning.Trainer, method)).parameters
    assert list(ours) == list(theirs)
    assert ours["weights_only"].default is None


def test_one_callback_on_the_command_line_and_class_path_callbacks_in_trainer_defaults():
    cli = LightningCLI(BoringModel, run=False, args=["--trainer.callbacks=LearningRateMonitor"],
                       trainer_defaults={"callbacks": {"class_path": "zerotrain.callbacks.ModelCheckpoint",
                                                       "init_args": {"monitor": "val_loss"}}})
    assert cli.config.trainer.callbacks.class_path.endswith(".LearningRateMonitor")  # one, not a list
    assert any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)
    given = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor == "val_loss"]
    assert len(given) == 1


def test_seed_everything_true_writes_the_seed_used_into_the_config():
    cli = LightningCLI(BoringModel, run=False, args=["--seed_everything=true", "--trainer.logger=false"])
    assert cli.config.seed_everything == int(os.environ["PL_GLOBAL_SEED"])
    cli = LightningCLI(BoringModel, run=False, args=["--seed_everything=false"], seed_everything_default=3)
    assert cli.config.seed_everything is False


def test_strategy_classes_take_their_options_on_the_command_line(capsys):
    # the class carries Lightning's name since 21eebc1 (DDP is the same class), so the command line takes it
    from zerotrain.strategies import DDP, ZeroStage2

    cli = LightningCLI(BoringModel, run=False, args=["--trainer.strategy=DDPStrategy",
                                                      "--trainer.strategy.find_unused_parameters=true",
                                                      "--trainer.strategy.bucket_cap_mb=50"])
    strategy = cli.config_init.trainer.strategy
    assert type(strategy) is DDP and strategy.config.find_unused_parameters is True
    assert strategy.config.bucket_cap_mb == 50
    cli = LightningCLI(BoringModel, run=False, args=["--trainer.strategy=ZeroStage2",
                                                      "--trainer.strategy.reduce_bucket_size=1000"])
    assert type(cli.config_init.trainer.strategy) is ZeroStage2
    assert cli.config_init.trainer.strategy.spec.buckets.reduce_bucket_size == 1000
    for bad in ("--trainer.strategy.bucket_cap_mb=big", "--trainer.strategy.no_such_option=1"):
        with pytest.raises(SystemExit) as exit_info:
            LightningCLI(BoringModel, run=False, args=["--trainer.strategy=DDPStrategy", bad])
        assert exit_info.value.code == 2
        assert bad.split("=")[0].rsplit(".", 1)[-1] in capsys.readouterr().err


@pytest.mark.parametrize("name", ["TensorBoardLogger", "CSVLogger"])
def test_a_logger_named_alone_is_the_trainers_logger(name):
    # zerotrain.fabric.loggers subclasses these under the same names; jsonargparse must not find two
    from zerotrain import loggers
    import zerotrain.fabric.loggers  # noqa: F401 - its classes exist in the process, as in any Fabric user's

    cli = LightningCLI(BoringModel, run=False, args=[f"--trainer.logger={name}", "--trainer.logger.save_dir=logs",
                                                   *_TRAINER])
    assert type(cli.trainer.logger) is getattr(loggers, name)
