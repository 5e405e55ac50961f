"""``BatchSizeFinder`` as a callback of the user's own fit (issue 41: a missing Lightning callback):
the search runs at the fit's start, sets ``model.batch_size`` and ``optimal_batch_size``, then the
same fit trains with the size found from the first step, weights and counters as before the search.
(``Tuner.scale_batch_size``, which ends its fit after the search, is test_conformance_tuning.py's.)
Compared with pytorch-lightning where installed."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets these on import / seeding
    for key in ("PYTORCH_NVML_BASED_CUDA_CHECK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(key, os.environ.get(key, "0"))


def _fit(L, module_base, root) -> dict:
    class Model(module_base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(3, 1)
            self.batch_size = 2
            self.sizes = []

        def training_step(self, batch, batch_idx):
            self.sizes.append(len(batch[0]))
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return DataLoader(TensorDataset(torch.randn(64, 3, generator=g)), batch_size=self.batch_size)

    finder = L.callbacks.BatchSizeFinder(mode="power", steps_per_trial=1, max_trials=3)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[finder],
                        default_root_dir=str(root))
    trainer.fit(model)
    return {"optimal": finder.optimal_batch_size, "attr": model.batch_size, "step": trainer.global_step,
            "trained_with": sorted(set(model.sizes[-trainer.global_step:])),
            "weight": model.layer.weight.detach().clone(), "left": sorted(os.listdir(root)) if os.path.isdir(root)
            else []}


def test_the_callback_searches_then_the_same_fit_trains_with_the_size_found(tmp_path):
    ours = _fit(zerotrain, zerotrain.TrainModule, tmp_path / "ours")
    assert ours["optimal"] == ours["attr"] == 8  # trials at 2, 4, 8 (max_trials=3), none out of memory
    assert ours["step"] == 64 // 8 and ours["trained_with"] == [8]
    assert ours["left"] == []  # the search's checkpoint removed


def test_the_callback_as_lightnings(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    ours = _fit(zerotrain, zerotrain.TrainModule, tmp_path / "ours")
    theirs = _fit(pl, pl.LightningModule, tmp_path / "theirs")
    torch.testing.assert_close(ours.pop("weight"), theirs.pop("weight"), rtol=0, atol=0)  # same ops, same order
    assert ours == theirs
