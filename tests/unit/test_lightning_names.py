"""Lightning's import paths, loggers and strategy strings under zerotrain: ported code renames
``lightning.pytorch`` to ``zerotrain`` and keeps the rest."""
from __future__ import annotations

import csv
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from zerotrain import ConfigError, Trainer
from zerotrain.strategies import registry
from zerotrain.strategies.ddp import DDP

PKG_PARENT = str(pathlib.Path(__import__("zerotrain").__file__).parent.parent)  # not resolved: a symlinked package


def test_lightning_module_paths_import_in_a_fresh_interpreter():
    code = ("from zerotrain.loggers import CSVLogger, TensorBoardLogger, Logger\n"
            "import zerotrain.utilities as u\n"
            "from zerotrain.utilities import rank_zero_only, rank_zero_info, rank_zero_warn, seed_everything\n"
            "from zerotrain.core import TrainModule\n"
            "from zerotrain.trainer import Trainer\n"
            "from zerotrain.callbacks import EarlyStopping, ModelCheckpoint, Timer, ModelSummary, "
            "LearningRateMonitor, TQDMProgressBar\n"
            "import zerotrain, zerotrain.loggers\n"
            "assert zerotrain.loggers.CSVLogger is CSVLogger and u.rank_zero_only.rank == 0\n"
            "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": PKG_PARENT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_rank_zero_only_reads_the_rank_when_called(monkeypatch):
    from zerotrain.utilities import rank_zero_only, seed_everything

    @rank_zero_only
    def f():
        return "ran"

    monkeypatch.setenv("RANK", "1")
    assert f() is None and rank_zero_only.rank == 1
    monkeypatch.setenv("RANK", "0")
    assert f() == "ran"
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # restored after: seed_everything records them
        monkeypatch.setenv(name, "0")
    assert seed_everything(7) == 7 and torch.initial_seed() == 7


def test_csv_logger_writes_lightnings_layout(tmp_path):
    from zerotrain.loggers import CSVLogger

    first = CSVLogger(str(tmp_path))
    first.log_hyperparams({"lr": 0.1, "layers": 2})
    first.log_metrics({"train_loss": 1.5}, step=0)
    first.log_metrics({"train_loss": 1.25, "val_loss": 2.0}, step=1)  # a new column rewrites the header
    first.finalize()
    assert first.log_dir == str(tmp_path / "lightning_logs" / "version_0")
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows == [{"step": "0", "train_loss": "1.5", "val_loss": ""},
                    {"step": "1", "train_loss": "1.25", "val_loss": "2.0"}]
    import yaml
    assert yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()) == {
        "lr": 0.1, "layers": 2}
    assert CSVLogger(str(tmp_path)).version == 1  # the next run gets the next version


def test_csv_logger_matches_pytorch_lightnings_file(tmp_path, monkeypatch):
    # importing pytorch-lightning sets this variable: restore the environment after
    pl_loggers = pytest.importorskip("pytorch_lightning.loggers")
    from zerotrain.loggers import CSVLogger

    rows = [({"a": 1.0}, 0), ({"a": 2.0, "b": 3.0}, 1), ({"b": 4.0}, 2)]
    for lg in (CSVLogger(str(tmp_path / "zt")), pl_loggers.CSVLogger(str(tmp_path / "pl"))):
        for metrics, step in rows:
            lg.log_metrics(metrics, step)
        lg.finalize("success") if isinstance(lg, pl_loggers.CSVLogger) else lg.finalize()
    ours = (tmp_path / "zt/lightning_logs/version_0/metrics.csv").read_text()
    theirs = (tmp_path / "pl/lightning_logs/version_0/metrics.csv").read_text()
    assert ours == theirs


def test_module_sees_the_trainers_loggers(tmp_path):
    from zerotrain import TrainModule
    from zerotrain.loggers import CSVLogger

    lg = CSVLogger(str(tmp_path))
    module = TrainModule()
    assert module.logger is None and module.loggers == []
    module._trainer = Trainer(accelerator="cpu", logger=[lg], enable_progress_bar=False,
                              enable_checkpointing=False, stall_timeout_s=None)
    assert module.logger is lg and module.loggers == [lg]


@pytest.mark.parametrize("name,kind,attrs", [
    ("single_device", "SingleDeviceStrategy", {}),
    ("ddp_find_unused_parameters_true", "DDPStrategy", {}),
    ("ddp_find_unused_parameters_false", "DDPStrategy", {"find_unused_parameters": False}),
    ("deepspeed", "ZeroStage2", {}),  # Lightning's DeepSpeedStrategy() is stage 2
    ("deepspeed_stage_1", "ZeroStage1", {}),
    ("deepspeed_stage_2", "ZeroStage2", {}),
    ("deepspeed_stage_3", "ZeroStage3", {}),
    ("deepspeed_stage_2_offload", "ZeroStage2", {"optimizer_device": "cpu"}),
    ("deepspeed_stage_3_offload", "ZeroStage3", {"optimizer_device": "cpu", "param_device": "cpu"}),
    ("deepspeed_stage_3_offload_nvme", "ZeroStage3", {"optimizer_device": "nvme", "param_device": "nvme",
                                                      "nvme_path": registry.DEFAULT_NVME_PATH}),
])
def test_lightning_strategy_strings_are_presets(name, kind, attrs):
    preset = registry.get(name)
    for key, value in attrs.items():
        assert preset.values[key] == value, (name, key)
    assert type(Trainer(accelerator="cpu", strategy=name, logger=False, enable_progress_bar=False,
                        stall_timeout_s=None).strategy).__name__ == kind
    if name == "ddp_find_unused_parameters_true":
        assert preset.values == {"find_unused_parameters": True}


@pytest.mark.parametrize("name, valid", [("fsdp", "'zero3'"), ("ddp_notebook", "'ddp'"),
                                         ("ddp_spawn_find_unused_parameters_true", "'ddp'"),
                                         ("fsdp_cpu_offload", "'deepspeed_stage_3_offload'")])
def test_lightning_strategy_strings_without_a_preset_say_why(name, valid):
    with pytest.raises(ConfigError, match=f"strategy='{name}' is Lightning's, with no zerotrain preset: "
                                          f".*valid: {valid}"):
        Trainer(accelerator="cpu", strategy=name, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match="strategy='nope' is not registered; valid choices: .*single_device"):
        Trainer(accelerator="cpu", strategy="nope", logger=False, enable_progress_bar=False)


@pytest.mark.parametrize("precision, plugin", [(16, "FP16Mixed"), ("16", "FP16Mixed"), ("bf16", "BF16Mixed"),
                                               (32, "Precision"), ("32-true", "Precision")])
def test_lightning_precision_aliases_on_the_trainer(precision, plugin):
    trainer = Trainer(accelerator="cpu", precision=precision, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, stall_timeout_s=None)
    assert type(trainer.precision_plugin).__name__ == plugin
    with pytest.raises(ConfigError, match="precision='16-true': is not supported .no pure fp16 training"):
        Trainer(accelerator="cpu", precision="16-true", logger=False)


def test_ddp_spawn_runs_as_ddp_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="zerotrain"):
        s = registry.strategy_from_name("ddp_spawn")
    assert isinstance(s, DDP)
    assert "strategy='ddp_spawn': runs as strategy='ddp'" in caplog.text


def test_gpu_is_lightnings_name_for_cuda():
    if torch.cuda.is_available():
        assert Trainer(accelerator="gpu", devices=1, logger=False, enable_progress_bar=False,
                       stall_timeout_s=None).accelerator == "cuda"
    else:  # refused at construction, as Lightning's, not when the ranks start
        with pytest.raises(ConfigError, match="accelerator='cuda' but this machine has no CUDA device"):
            Trainer(accelerator="gpu", devices=1)
    with pytest.raises(ConfigError, match="accelerator='tpu'"):
        Trainer(accelerator="tpu")
