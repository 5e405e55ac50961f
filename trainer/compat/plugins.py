"""Lightning's checkpoint-IO plugins (``lightning.fabric.plugins``): ``TorchCheckpointIO`` writes
and reads one checkpoint dict as one ``torch.save`` file, as Lightning's does. zerotrain's Trainer
writes its own checkpoint layout (README "Checkpoints") and does not route through these."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from .internals import XLACheckpointIO  # noqa: F401  (Lightning's name, importable only)


class CheckpointIO:
    """Writes, reads and removes checkpoint dicts at paths."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: "str | os.PathLike", storage_options: Any = None) -> None:
        raise NotImplementedError

    def load_checkpoint(self, path: "str | os.PathLike", map_location: Any = None, weights_only: bool | None = None) -> Any:
        raise NotImplementedError

    def remove_checkpoint(self, path: "str | os.PathLike") -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        """Nothing held."""


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load`` of the whole dict at a local path (parent folders made)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: "str | os.PathLike", storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                            f"supported for `{type(self).__name__}`. Please implement your custom `CheckpointIO` "
                            "to define how you'd like to use `storage_options`.")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, path)

    def load_checkpoint(self, path: "str | os.PathLike", map_location: "Callable | Any" = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> Any:
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, weights_only=bool(weights_only))

    def remove_checkpoint(self, path: "str | os.PathLike") -> None:
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


__all__ = ["CheckpointIO", "TorchCheckpointIO", "XLACheckpointIO"]
