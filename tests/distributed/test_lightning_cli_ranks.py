"""``zerotrain.cli.LightningCLI`` on 2 processes (issue 44): a script in Lightning's style run as a
user runs it (``python script.py fit --trainer.strategy=S --trainer.devices=2``; rank 0 launches
rank 1, which re-runs the script and parses the same arguments), under ddp and zero3 - the latter
also given as a class with an option (``--trainer.strategy=ZeroStage3
--trainer.strategy.prefetch_bucket_size=...``). Each run exits 0 and saves its config once; every
rank's losses under zero3 equal ddp's exactly (tolerance: exact - SGD, and each step's gradient is
the mean of 2 ranks' gradients: a sum of two fp32 terms does not depend on the order and halving is
exact, so both strategies compute the same numbers). A bad value ends with exit code 2 before rank
1 exists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TIMEOUT_SCALE = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))

SCRIPT = '''
import json, os
import torch
from torch.utils.data import DataLoader, TensorDataset
from zerotrain import DataModule, TrainModule
from zerotrain.cli import LightningCLI


class Regression(TrainModule):
    def __init__(self, hidden: int = 8, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self):
        path = os.path.join(self.trainer.default_root_dir, f"losses_{self.global_rank}.json")
        with open(path, "w") as f:
            json.dump(self.losses, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(DataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        self.data = TensorDataset(x, x.sum(1, keepdim=True).sin())

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


if __name__ == "__main__":
    LightningCLI(Regression, Data)
'''

COMMON = ["fit", "--seed_everything=3", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=6",
          "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
          "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false"]


def _run(tmp_path: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / name
    return subprocess.run([sys.executable, str(script), *COMMON, f"--trainer.default_root_dir={root}", *args],
                          capture_output=True, text=True, timeout=180 * TIMEOUT_SCALE, cwd=tmp_path)


def _losses(tmp_path: Path, name: str, *args: str) -> list[list[float]]:
    proc = _run(tmp_path, name, *args)
    assert proc.returncode == 0, f"{name}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    saved = yaml.safe_load((tmp_path / name / "config.yaml").read_text())
    assert saved["trainer"]["devices"] == 2 and saved["seed_everything"] == 3
    return [json.loads((tmp_path / name / f"losses_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow  # moved out of the default suite for its 15-minute budget (16.2 min on an AVX2 EPYC)
def test_cli_script_under_ddp_and_zero3_on_two_processes(tmp_path):
    ddp = _losses(tmp_path, "ddp", "--trainer.strategy=ddp")
    assert [len(per_rank) for per_rank in ddp] == [6, 6] and ddp[0] != ddp[1]  # each rank its own batches
    assert _losses(tmp_path, "zero3", "--trainer.strategy=zero3") == ddp
    assert _losses(tmp_path, "zero3_class", "--trainer.strategy=ZeroStage3",
                   "--trainer.strategy.prefetch_bucket_size=1000") == ddp


def test_a_bad_value_exits_2_before_any_rank_starts(tmp_path):
    proc = _run(tmp_path, "bad", "--trainer.strategy=zero3", "--trainer.strategy.no_such=1", "--model.hidden=wide")
    assert proc.returncode == 2
    assert "hidden" in proc.stderr or "no_such" in proc.stderr
    assert not (tmp_path / "bad").exists()  # no rank ran, nothing was written
