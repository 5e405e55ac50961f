"""Lightning calls the evaluation and predict batch hooks without ``dataloader_idx`` when a stage
has one loader, so a module or callback hook written ``on_validation_batch_end(self, outputs,
batch, batch_idx)`` runs unchanged (issue 41: "the same holds for dataloader_idx and the other
optional hook arguments"). Compared with pytorch-lightning where installed."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import zerotrain

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets it on import
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))


def _run(L, module_base, root) -> list:
    """fit (one validation loader), test and predict with batch hooks that take no dataloader_idx."""
    seen = []

    class Module(module_base):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def validation_step(self, batch, batch_idx):
            pass

        def test_step(self, batch, batch_idx):
            pass

        def predict_step(self, batch, batch_idx):
            return self.layer(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_validation_batch_start(self, batch, batch_idx):
            seen.append(("module", "validation_start", batch_idx))

        def on_validation_batch_end(self, outputs, batch, batch_idx):
            seen.append(("module", "validation_end", batch_idx))

        def on_test_batch_end(self, outputs, batch, batch_idx):
            seen.append(("module", "test_end", batch_idx))

        def on_predict_batch_start(self, batch, batch_idx):
            seen.append(("module", "predict_start", batch_idx))

    class Hooks(L.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(("callback", "validation_end", batch_idx))

        def on_test_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(("callback", "test_start", batch_idx))

        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(("callback", "predict_end", batch_idx))

    def data():
        return DataLoader(TensorDataset(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))), batch_size=2)

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[Hooks()], default_root_dir=str(root))
    module = Module()
    trainer.fit(module, data(), data())
    trainer.test(module, data(), verbose=False)
    trainer.predict(module, data())
    return seen


def test_batch_hooks_without_dataloader_idx_run_on_one_loader(tmp_path):
    ours = _run(zerotrain, zerotrain.TrainModule, tmp_path)
    expected = [(who, hook, i) for i in (0, 1) for who, hook in
                (("module", "validation_start"), ("callback", "validation_end"), ("module", "validation_end"))]
    expected += [(who, hook, i) for i in (0, 1) for who, hook in (("callback", "test_start"), ("module", "test_end"))]
    expected += [(who, hook, i) for i in (0, 1) for who, hook in (("module", "predict_start"),
                                                                  ("callback", "predict_end"))]
    assert ours == expected


def test_batch_hooks_without_dataloader_idx_as_lightning(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    assert _run(zerotrain, zerotrain.TrainModule, tmp_path / "ours") == _run(pl, pl.LightningModule,
                                                                             tmp_path / "theirs")
