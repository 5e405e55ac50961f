"""``deepspeed.git_version_info``: what a DeepSpeed build records about itself, which scripts and
test helpers read to gate features (``torch_info['version']``, ``torch_info['cuda_version']``, ...).

Here: the DeepSpeed release this face follows, and the torch it runs on as torch reports it at
import. No op is prebuilt (``installed_ops`` is empty: zerotrain compiles its kernels itself)."""
from __future__ import annotations

import torch

version = "0.19.8"
git_hash = git_branch = "zerotrain"
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = {}


def _major_minor(text: str | None) -> str:
    """'2.7.1+cpu' -> '2.7'; None (no CUDA, no NCCL, no HIP) -> '0.0', DeepSpeed's 'unknown'."""
    if not text:
        return "0.0"
    return ".".join(text.split("+")[0].split(".")[:2])


def _nccl_version() -> str:
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        return "0.0"
    try:
        found = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return "0.0"
    return ".".join(str(part) for part in found[:2]) if isinstance(found, tuple) else "0.0"


accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "accelerator_name", "torch_info"]
