"""``zerotrain.utilities.imports`` (and ``zerotrain.fabric.utilities.imports``): which optional
packages and versions are present, under Lightning's names (``lightning.pytorch.utilities.imports``
and ``lightning.fabric.utilities.imports``), for code that checks them."""
from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata

import torch
from packaging.version import Version


def package_available(name: str) -> bool:
    """``name`` can be imported (found on the path; not imported here)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version_at_least(distribution: str, minimum: str) -> bool:
    """The installed ``distribution`` is ``minimum`` or newer (False when it is absent)."""
    try:
        return Version(metadata.version(distribution)) >= Version(minimum)
    except metadata.PackageNotFoundError:
        return False


_TORCH_VERSION = Version(Version(torch.__version__).base_version)
_IS_WINDOWS = platform.system() == "Windows"
_IS_INTERACTIVE = hasattr(sys, "ps1") or bool(sys.flags.interactive)
_NUMPY_AVAILABLE = package_available("numpy")
_PYTHON_GREATER_EQUAL_3_10_0 = sys.version_info >= (3, 10)
_PYTHON_GREATER_EQUAL_3_11_0 = sys.version_info >= (3, 11)
_TORCH_GREATER_EQUAL_2_2 = _TORCH_VERSION >= Version("2.2.0")
_TORCH_GREATER_EQUAL_2_3 = _TORCH_VERSION >= Version("2.3.0")
_TORCH_GREATER_EQUAL_2_4 = _TORCH_VERSION >= Version("2.4.0")
_TORCH_GREATER_EQUAL_2_4_1 = _TORCH_VERSION >= Version("2.4.1")
_TORCH_GREATER_EQUAL_2_5 = _TORCH_VERSION >= Version("2.5.0")
_TORCH_GREATER_EQUAL_2_6 = _TORCH_VERSION >= Version("2.6.0")
_TORCH_LESS_EQUAL_2_6 = _TORCH_VERSION <= Version("2.6.0")
_TORCH_GREATER_EQUAL_2_8 = _TORCH_VERSION >= Version("2.8.0")
_TORCH_EQUAL_2_8 = Version("2.8.0") <= _TORCH_VERSION < Version("2.9.0")
_TORCH_EQUAL_2_9 = Version("2.9.0") <= _TORCH_VERSION < Version("2.10.0")
_TORCHMETRICS_GREATER_EQUAL_0_8_0 = version_at_least("torchmetrics", "0.8.0")
_TORCHMETRICS_GREATER_EQUAL_0_9_1 = version_at_least("torchmetrics", "0.9.1")
_TORCHMETRICS_GREATER_EQUAL_0_11 = version_at_least("torchmetrics", "0.11.0")
_TORCHMETRICS_GREATER_EQUAL_1_0_0 = version_at_least("torchmetrics", "1.0.0")
_OMEGACONF_AVAILABLE = package_available("omegaconf")
_TORCHVISION_AVAILABLE = package_available("torchvision")
_RICH_AVAILABLE = version_at_least("rich", "10.2.2")
_ONNX_AVAILABLE = package_available("onnx")
_TENSORBOARD_AVAILABLE = package_available("tensorboard")
_TENSORBOARDX_AVAILABLE = package_available("tensorboardX")


def rich_available() -> bool:
    """Whether ``rich`` (10.2.2 or later) is there: Lightning's ``_RICH_AVAILABLE``, read at each call
    (a test that switches the flag off here is seen)."""
    return _RICH_AVAILABLE
