"""``zerotrain.demos.boring_classes`` (its names are ``zerotrain.demos``'s too): the small models and random data
sets Lightning's users and tests import from ``lightning.pytorch.demos``, under the same names and
with the same behaviour (shapes, optimizers, the order their random numbers are drawn in), so a
ported test builds the same model and data. For tests and debugging only."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from ..api.datamodule import DataModule
from .transformer import LightningTransformer, Transformer, WikiText2
from ..api.module import TrainModule


class RandomDataset(Dataset):
    """``length`` random vectors of ``size`` numbers, drawn once when built."""

    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class RandomDictDataset(RandomDataset):
    """As ``RandomDataset``, each sample a dict ``{"a": x, "b": x + 2}``."""

    def __getitem__(self, index: int) -> dict[str, Tensor]:  # type: ignore[override]
        x = self.data[index]
        return {"a": x, "b": x + 2}


class RandomIterableDataset(IterableDataset):
    """``count`` random vectors of ``size`` numbers, drawn as they are iterated; no length."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.randn(self.size) for _ in range(self.count))


class RandomIterableDatasetWithLen(RandomIterableDataset):
    """``RandomIterableDataset`` that reports its length."""

    def __len__(self) -> int:
        return self.count


def _loader(dataset: Any) -> DataLoader:
    return DataLoader(dataset)


class BoringModel(TrainModule):
    """One ``Linear(32, 2)`` trained to output ones (MSE) by SGD(lr=0.1) with a per-epoch
    ``StepLR(step_size=1)``; every stage's loader is 64 random vectors, batch size 1. Subclass it
    and override what a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def loss(self, preds: Tensor, labels: Tensor | None = None) -> Tensor:
        return F.mse_loss(preds, torch.ones_like(preds) if labels is None else labels)

    def step(self, batch: Any) -> Tensor:
        return self.loss(self(batch))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return {"x": self.step(batch)}

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return {"y": self.step(batch)}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return _loader(RandomDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return _loader(RandomDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return _loader(RandomDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return _loader(RandomDataset(32, 64))


class ManualOptimBoringModel(BoringModel):
    """``BoringModel`` under manual optimization: zero_grad, manual_backward, step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        loss = self.step(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


#: the stages whose ``setup`` builds a data set, and the attribute each one's loader reads
_SPLITS = {"train": ("fit",), "val": ("fit", "validate"), "test": ("test",), "predict": ("predict",)}


class BoringDataModule(DataModule):
    """256 random vectors of 32 numbers, split into four blocks of 64: train, val, test, predict."""

    def __init__(self) -> None:
        super().__init__()
        self.random_full = RandomDataset(32, 64 * 4)

    def setup(self, stage: str) -> None:
        for block, (split, stages) in enumerate(_SPLITS.items()):
            if stage in stages:
                setattr(self, f"random_{split}", Subset(self.random_full, range(64 * block, 64 * (block + 1))))

    def train_dataloader(self) -> DataLoader:
        return _loader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return _loader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return _loader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return _loader(self.random_predict)


class BoringDataModuleNoLen(BoringDataModule):
    """As ``BoringDataModule``, with iterable data sets of no length (512 / 128 / 256 / 64)."""

    def __init__(self) -> None:
        DataModule.__init__(self)

    def setup(self, stage: str) -> None:
        counts = {"train": 512, "val": 128, "test": 256, "predict": 64}
        for split, stages in _SPLITS.items():
            if stage in stages:
                setattr(self, f"random_{split}", RandomIterableDataset(32, counts[split]))


class IterableBoringDataModule(DataModule):
    """Each stage gives two loaders: a map-style and an iterable data set of 4-number vectors
    (16 / 32 / 64 / 128 samples each)."""

    def setup(self, stage: str) -> None:
        counts = {"train": 16, "val": 32, "test": 64, "predict": 128}
        for split, stages in _SPLITS.items():
            if stage in stages:
                setattr(self, f"{split}_datasets", [RandomDataset(4, counts[split]),
                                                    RandomIterableDataset(4, counts[split])])

    def train_dataloader(self) -> Any:
        return [_loader(d) for d in self.train_datasets]

    def val_dataloader(self) -> Any:
        return [_loader(d) for d in self.val_datasets]

    def test_dataloader(self) -> Any:
        return [_loader(d) for d in self.test_datasets]

    def predict_dataloader(self) -> Any:
        return [_loader(d) for d in self.predict_datasets]


class DemoModel(TrainModule):
    """``relu(Linear(32, out_dim))`` of the flattened input; the loss is the output's sum; Adam."""

    def __init__(self, out_dim: int = 10, learning_rate: float = 0.02) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, out_dim)
        self.learning_rate = learning_rate

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.l1(x.view(x.size(0), -1)))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)


class Net(nn.Module):
    """The MNIST convolutional classifier of PyTorch's example (28x28 inputs, log-probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


__all__ = ["BoringModel", "BoringDataModule", "BoringDataModuleNoLen", "IterableBoringDataModule", "DemoModel",
           "LightningTransformer", "ManualOptimBoringModel", "Net", "RandomDataset", "RandomDictDataset",
           "RandomIterableDataset", "RandomIterableDatasetWithLen", "Transformer", "WikiText2"]
