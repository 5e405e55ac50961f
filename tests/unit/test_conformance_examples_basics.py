"""What Lightning's examples/pytorch/basics needed (issue 41; bench/CONFORMANCE.md): a fit cut
mid-epoch by ``max_steps`` still ends its epoch (``on_train_epoch_end``, so the default
ModelCheckpoint saves and ``ckpt_path="best"`` finds it; the epoch counter moves on; no epoch
scheduler steps), compared with pytorch-lightning where installed; and the names the scripts
import: ``demos.mnist_datamodule.MNIST``, ``utilities.model_helpers.get_torchvision_model``,
``profilers.pytorch.PyTorchProfiler``."""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):  # pytorch-lightning sets it on import
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))


def _cut_fit(L, root):
    """max_steps=3 of a 8-batch epoch, an epoch StepLR; what the run saw."""
    seen = []

    class Model(L.LightningModule if hasattr(L, "LightningModule") else L.TrainModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def on_train_epoch_end(self):
            seen.append(("epoch_end", self.trainer.current_epoch, self.trainer.global_step))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)

    trainer = L.Trainer(default_root_dir=root, max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model)
    best = trainer.checkpoint_callback.best_model_path
    return {"hooks": seen, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "best": os.path.relpath(best, root) if best else "",
            "lr": trainer.optimizers[0].param_groups[0]["lr"]}


def test_a_fit_cut_by_max_steps_ends_its_epoch_as_lightning(tmp_path):
    import zerotrain
    mine = _cut_fit(zerotrain, str(tmp_path / "z"))
    assert mine == {"hooks": [("epoch_end", 0, 3)], "epoch": 1, "step": 3,
                    "best": os.path.join("checkpoints", "epoch=0-step=3.ckpt"), "lr": 0.1}
    try:
        import pytorch_lightning
    except ImportError:
        return
    assert mine == _cut_fit(pytorch_lightning, str(tmp_path / "pl"))


def test_the_mnist_demo_is_torchvisions_when_present_else_the_tensor_files(tmp_path, monkeypatch):
    from zerotrain.demos.mnist_datamodule import MNIST, TensorMNIST
    folder = tmp_path / "MNIST" / "complete"
    folder.mkdir(parents=True)
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    for name in ("training.pt", "test.pt"):
        torch.save((images, torch.arange(5)), folder / name)
    monkeypatch.setenv("PL_USE_MOCKED_MNIST", "1")
    ds = MNIST(str(tmp_path), train=False, download=False)
    assert isinstance(ds, TensorMNIST) and len(ds) == 5
    x, y = ds[2]
    assert y == 2 and x.shape == (1, 28, 28)
    torch.testing.assert_close(x, (images[2].float().unsqueeze(0) - 0.1307) / 0.3081)
    with pytest.raises(RuntimeError, match="Dataset not found"):
        MNIST(str(tmp_path / "none"), download=False)

    made = []
    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=lambda *a, **k: made.append((a, k)) or "tv")
    fake.models = types.SimpleNamespace(get_model=lambda name, **k: (name, k))
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake.datasets)
    monkeypatch.setitem(sys.modules, "torchvision.models", fake.models)
    monkeypatch.delenv("PL_USE_MOCKED_MNIST")
    monkeypatch.setattr("zerotrain.trainer.demos.mnist_datamodule.package_available", lambda name: True)
    assert MNIST("root", train=True) == "tv"
    assert made == [(("./data",), {"download": True}), (("root",), {"train": True})]
    from zerotrain.utilities.model_helpers import get_torchvision_model
    assert get_torchvision_model("resnet18", weights="DEFAULT") == ("resnet18", {"weights": "DEFAULT"})


def test_the_pytorch_profiler_records_named_actions_and_writes_a_trace(tmp_path):
    from zerotrain.profilers import PyTorchProfiler as Same
    from zerotrain.profilers.pytorch import PyTorchProfiler
    assert Same is PyTorchProfiler
    prof = PyTorchProfiler(dirpath=str(tmp_path), filename="p")
    prof.setup("fit", local_rank=0)
    with prof.profile("my_action"):
        torch.ones(8).mul(2)
    assert "my_action" in prof.summary()
    prof.teardown("fit")
    assert os.listdir(tmp_path) == ["fit-p-rank0.pt.trace.json"]


def test_an_unshuffled_training_loader_is_shuffled_on_several_ranks_as_lightning(monkeypatch):
    """Lightning's training DistributedSampler shuffles whatever the loader says (its examples'
    loaders do not shuffle); evaluation loaders keep their order."""
    from zerotrain import Trainer
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    strategy = type(trainer._strategy)
    monkeypatch.setattr(strategy, "data_parallel_world_size", property(lambda s: 2))
    monkeypatch.setattr(strategy, "data_parallel_rank", property(lambda s: 1))
    data = TensorDataset(torch.arange(8))
    train = trainer._prepare_loader(DataLoader(data, batch_size=2), "fit")
    assert type(train.sampler).__name__ == "DistributedSampler" and train.sampler.shuffle
    assert [int(i) for (b,) in train for i in b] == torch.randperm(8, generator=torch.Generator().manual_seed(
        trainer.data_seed)).tolist()[1::2]
    test = trainer._prepare_loader(DataLoader(data, batch_size=2), "test")
    assert not test.sampler.shuffle and [int(i) for (b,) in test for i in b] == [1, 3, 5, 7]
