"""``trainer.received_sigterm`` (issue 41: a missing Trainer attribute): False before and during a
fit without a signal, True once SIGTERM reached the fit, as Lightning's flag. Compared with
pytorch-lightning where installed (both end the fit with their SIGTERMException)."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets it on import
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))


def _fit(L, module_base, root, send: bool) -> tuple:
    seen = []

    class Net(module_base):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            seen.append(self.trainer.received_sigterm)
            if send and batch_idx == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    before = trainer.received_sigterm
    error = None
    try:
        trainer.fit(Net())
    except BaseException as exc:  # noqa: BLE001 - SIGTERMException is a SystemExit; compared below
        error = type(exc).__name__
    return before, seen, trainer.received_sigterm, error


def test_received_sigterm_is_false_without_a_signal(tmp_path):
    assert _fit(zerotrain, zerotrain.TrainModule, tmp_path, send=False) == (False, [False] * 4, False, None)


def test_received_sigterm_after_a_sigterm_in_fit(tmp_path):
    before, seen, after, error = _fit(zerotrain, zerotrain.TrainModule, tmp_path, send=True)
    assert (before, seen[:2], after, error) == (False, [False, False], True, "SIGTERMException")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the fit's handler is gone


def test_received_sigterm_as_lightnings(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    kept = signal.getsignal(signal.SIGTERM)
    try:
        theirs = _fit(pl, pl.LightningModule, tmp_path / "theirs", send=True)
    finally:
        signal.signal(signal.SIGTERM, kept)
    ours = _fit(zerotrain, zerotrain.TrainModule, tmp_path / "ours", send=True)
    assert ours == theirs
