"""Lightning's plugins (``lightning.pytorch.plugins``, ``lightning.fabric.plugins``):
``TorchCheckpointIO`` writes and reads one checkpoint dict as one ``torch.save`` file, as
Lightning's does (zerotrain's Trainer writes its own checkpoint layout, README "Checkpoints", and
does not route through it). Precision plugins, cluster environments and layer-sync plugins are
names only: zerotrain takes ``Trainer(precision=...)`` and detects torchrun/SLURM/its launcher
itself; constructing one raises ``NotImplementedError`` saying so."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from .internals import XLACheckpointIO, _internal

_PATH = "str | os.PathLike"


class CheckpointIO:
    """Writes, reads and removes checkpoint dicts at paths."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        raise NotImplementedError

    def load_checkpoint(self, path: _PATH, map_location: Any = None, weights_only: bool | None = None) -> Any:
        raise NotImplementedError

    def remove_checkpoint(self, path: "str | os.PathLike") -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        """Nothing held."""


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load`` of the whole dict at a local path (parent folders made)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                            f"supported for `{type(self).__name__}`. Please implement your custom `CheckpointIO` "
                            "to define how you'd like to use `storage_options`.")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{os.fspath(path)}.tmp"  # atomic: a crash mid-write leaves the previous file
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)

    def load_checkpoint(self, path: "str | os.PathLike", map_location: "Callable | Any" = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> Any:
        if weights_only is False:  # a full unpickle can run code: zerotrain never loads that way
            raise ValueError(f"{type(self).__name__}.load_checkpoint(weights_only=False): zerotrain loads "
                             "checkpoints with weights_only=True only (a full unpickle can run code); "
                             "valid: None or True")
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, weights_only=True)

    def remove_checkpoint(self, path: "str | os.PathLike") -> None:
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


_PRECISION = "pass Trainer(precision='32-true' | 'bf16-mixed' | '16-mixed' | ...) instead"
_ENVIRONMENT = "zerotrain reads torchrun's, SLURM's or its own launcher's variables itself"
Precision = _internal("Precision", "precision plugin", why=_PRECISION)
for _name in ("HalfPrecision", "DoublePrecision", "MixedPrecision", "DeepSpeedPrecision", "FSDPPrecision",
              "XLAPrecision", "TransformerEnginePrecision", "BitsandbytesPrecision"):
    globals()[_name] = _internal(_name, "precision plugin", Precision, why=_PRECISION)
ClusterEnvironment = _internal("ClusterEnvironment", "cluster environment", why=_ENVIRONMENT)
for _name in ("LightningEnvironment", "SLURMEnvironment", "TorchElasticEnvironment", "KubeflowEnvironment",
              "LSFEnvironment", "MPIEnvironment", "XLAEnvironment"):
    globals()[_name] = _internal(_name, "cluster environment", ClusterEnvironment, why=_ENVIRONMENT)
LayerSync = _internal("LayerSync", "layer-sync plugin", why="zerotrain has no SyncBatchNorm conversion plugin")
TorchSyncBatchNorm = _internal("TorchSyncBatchNorm", "layer-sync plugin", LayerSync,
                               why="convert with torch.nn.SyncBatchNorm.convert_sync_batchnorm yourself")
AsyncCheckpointIO = _internal("AsyncCheckpointIO", "asynchronous checkpoint IO", CheckpointIO,
                              why="zerotrain's checkpoints are written by every rank in parallel")
del _name

__all__ = ["CheckpointIO", "TorchCheckpointIO", "XLACheckpointIO", "Precision", "ClusterEnvironment"]
