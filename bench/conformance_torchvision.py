"""A stand-in ``torchvision`` for the examples harness (conformance_examples.py): no torchvision
wheel imports with this torch, and Lightning's examples/pytorch/basics need a few of its names.
``write(folder)`` puts a small package of our own there (plus a dist-info, so
``RequirementCache("torchvision")`` finds it); the Lightning and the zerotrain runs import the same
one. Images are seeded random uint8 tensors of the real datasets' shapes (item ``i`` of a split is
always the same); ``models.get_model``/``resnet18`` build a ResNet-18-shaped network whose
"pretrained" weights come from a fixed seed (no download, and the global RNG is left as it was);
``utils.save_image`` writes nothing. Any other name of ``models``/``ops``/``transforms`` (torchmetrics
imports some when torchvision is present) is a function raising NotImplementedError when called."""
from __future__ import annotations

import os

VERSION = "0.22.0"

_INIT = f'''__version__ = "{VERSION}"
from . import datasets, models, ops, transforms, utils  # noqa: F401
'''
#: appended to models, ops and transforms: other names exist and refuse to run
_OTHERS = '''

def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"the stand-in torchvision has no {__name__}.{name}")
    return missing
'''

_DATASETS = '''import torch
from torch.utils.data import Dataset


class _Random(Dataset):
    shape, classes, sizes, salt = (), 10, (0, 0), 0

    def __init__(self, root=None, train=True, transform=None, target_transform=None, download=False):
        self.root, self.train, self.transform, self.target_transform = root, train, transform, target_transform

    def __len__(self):
        return self.sizes[0 if self.train else 1]

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.salt * 10_000_000 + (0 if self.train else 5_000_000) + int(i))
        img = torch.randint(0, 256, self.shape, generator=g, dtype=torch.uint8)
        target = int(torch.randint(0, self.classes, (), generator=g))
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class MNIST(_Random):
    shape, sizes, salt = (28, 28), (60000, 10000), 1


class CIFAR10(_Random):
    shape, sizes, salt = (3, 32, 32), (50000, 10000), 2
'''

_TRANSFORMS = '''import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, img):
        img = img.unsqueeze(0) if img.dim() == 2 else img
        return img.float().div(255) if img.dtype == torch.uint8 else img.float()


class Normalize:
    def __init__(self, mean, std, inplace=False):
        self.mean, self.std = mean, std

    def __call__(self, x):
        mean = torch.as_tensor(self.mean, dtype=x.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=x.dtype).view(-1, 1, 1)
        return (x - mean) / std


class Resize:
    def __init__(self, size, **kwargs):
        self.size = size

    def __call__(self, img):
        h, w = img.shape[-2:]
        if isinstance(self.size, int):
            s = self.size
            size = (s, max(1, round(w * s / h))) if h <= w else (max(1, round(h * s / w)), s)
        else:
            size = tuple(self.size)
        x = img.unsqueeze(0) if img.dim() == 3 else img.unsqueeze(0).unsqueeze(0)
        out = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False)
        out = out.round().clamp(0, 255).to(torch.uint8) if img.dtype == torch.uint8 else out
        return out.reshape(*img.shape[:-2], *size)


class CenterCrop:
    def __init__(self, size):
        self.size = (size, size) if isinstance(size, int) else tuple(size)

    def __call__(self, img):
        h, w = img.shape[-2:]
        top, left = (h - self.size[0]) // 2, (w - self.size[1]) // 2
        return img[..., top:top + self.size[0], left:left + self.size[1]]
'''

_UTILS = '''import torch


def make_grid(tensor, **kwargs):
    return torch.as_tensor(tensor)


def save_image(tensor, fp, format=None, **kwargs):
    return None
'''

_MODELS = '''import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, cin = (64, 128, 256, 512), 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(_Block(cin, w, stride), _Block(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(weights=None, progress=True, **kwargs):
    if weights is None:
        return ResNet(**kwargs)
    with torch.random.fork_rng(devices=[]):  # "pretrained": fixed weights, the caller's RNG untouched
        torch.manual_seed(18)
        return ResNet(**kwargs)


def get_model(name, **kwargs):
    return {"resnet18": resnet18}[name](**kwargs)
'''

FILES = {"__init__.py": _INIT, "datasets.py": _DATASETS, "transforms.py": _TRANSFORMS + _OTHERS,
         "utils.py": _UTILS, "models.py": _MODELS + _OTHERS, "ops.py": '"""Nothing of torchvision.ops."""' + _OTHERS}


def write(folder: str) -> str:
    """The stand-in package under ``folder`` (returned: the folder to put on PYTHONPATH)."""
    pkg = os.path.join(folder, "torchvision")
    info = os.path.join(folder, f"torchvision-{VERSION}.dist-info")
    os.makedirs(pkg, exist_ok=True)
    os.makedirs(info, exist_ok=True)
    for name, text in FILES.items():
        with open(os.path.join(pkg, name), "w") as f:
            f.write(text)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: torchvision\nVersion: {VERSION}\n")
    return folder
