"""``zerotrain.demos.mnist_datamodule``: ``MNIST(root, train=..., transform=..., download=...)``,
the data set Lightning's examples (autoencoder, backbone classifier) import from
``lightning.pytorch.demos.mnist_datamodule``. As there, it is torchvision's MNIST when torchvision
is installed (and ``PL_USE_MOCKED_MNIST`` is unset); otherwise a small reader of the same images
kept as ``(uint8 images, labels)`` tensors in ``root/MNIST/complete/{training,test}.pt``
(downloaded from Lightning's public copy when missing): items are ``(1x28x28 float image,
normalized by (mean, std), int label)``. For tests and debugging only."""
from __future__ import annotations

import os
import urllib.request
from typing import Any

import torch
from torch.utils.data import Dataset

from ..compat.imports import package_available

#: Lightning's public copy of the processed MNIST tensors
MNIST_URL = "https://pl-public-data.s3.amazonaws.com/MNIST/processed/"
_DATASETS_PATH = "./data"


class TensorMNIST(Dataset):
    """MNIST from the two saved tensor files (no torchvision needed)."""

    def __init__(self, root: str, train: bool = True, normalize: tuple = (0.1307, 0.3081), download: bool = True,
                 **kwargs: Any) -> None:
        self.root, self.train, self.normalize = root, train, normalize
        folder = os.path.join(root, "MNIST", "complete")
        files = ("training.pt", "test.pt")
        if download and not all(os.path.isfile(os.path.join(folder, f)) for f in files):
            os.makedirs(folder, exist_ok=True)
            for name in files:
                urllib.request.urlretrieve(MNIST_URL + name, os.path.join(folder, name))  # noqa: S310
        path = os.path.join(folder, files[0] if train else files[1])
        if not os.path.isfile(path):
            raise RuntimeError(f"Dataset not found: {path} (download=True fetches it)")
        self.data, self.targets = torch.load(path, weights_only=True)  # two tensors: nothing to unpickle

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.data[index].float().unsqueeze(0)
        if self.normalize is not None and len(self.normalize) == 2:
            image = (image - self.normalize[0]) / self.normalize[1]
        return image, int(self.targets[index])

    def __len__(self) -> int:
        return len(self.data)


def MNIST(*args: Any, **kwargs: Any) -> Dataset:  # noqa: N802 (Lightning's name)
    """torchvision's MNIST (its files fetched into ``./data`` first, as Lightning's demo does) when
    torchvision is installed and ``PL_USE_MOCKED_MNIST`` is unset; ``TensorMNIST`` otherwise."""
    if package_available("torchvision") and not os.getenv("PL_USE_MOCKED_MNIST"):
        from torchvision.datasets import MNIST as TorchvisionMNIST

        TorchvisionMNIST(_DATASETS_PATH, download=True)
        return TorchvisionMNIST(*args, **kwargs)
    return TensorMNIST(*args, **kwargs)


__all__ = ["MNIST", "TensorMNIST"]
