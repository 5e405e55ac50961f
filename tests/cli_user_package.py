"""A user's own package, written into a folder outside the repository, for the tests of
``zerotrain-train`` with ``model._target_`` / ``data._target_`` (tests/unit/test_cli_targets.py,
tests/distributed/test_cli_targets.py): a TrainModule whose weights are drawn in ``__init__`` and
that records each step's loss (global rank 0, to ``record``), and a DataModule of fixed random data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOURCE = '''
import json
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zerotrain import DataModule, TrainModule


class Regressor(TrainModule):
    def __init__(self, hidden: int, lr: float = 0.1, depth: int = 2, record: str = ""):
        super().__init__()
        self.save_hyperparameters()
        layers = [nn.Linear(8, hidden), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(hidden, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def on_train_end(self):
        if self.hparams.record and self.trainer.is_global_zero:
            with open(self.hparams.record, "w") as f:
                json.dump(self.losses, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Points(DataModule):
    def __init__(self, batch_size: int = 4, n: int = 64):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 8, generator=g)
        self.ds = TensorDataset(x, x.sin().sum(1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=self.batch_size)
'''

MODEL, DATA = "userpkg.models.Regressor", "userpkg.models.Points"


def write_package(folder: Path) -> Path:
    """``folder/userpkg/models.py``; returns ``folder`` (for PYTHONPATH)."""
    pkg = Path(folder) / "userpkg"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(SOURCE)
    return Path(folder)


def run_cli(pkg_root: Path, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m zerotrain.train *args`` with the user's package on PYTHONPATH, run in ``cwd``
    (outside the repository)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(pkg_root), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    return subprocess.run([sys.executable, "-m", "zerotrain.train", *args], capture_output=True, text=True,
                          timeout=timeout * scale, cwd=cwd, env=env)


def read_losses(path: Path) -> list[float]:
    return json.loads(Path(path).read_text())
