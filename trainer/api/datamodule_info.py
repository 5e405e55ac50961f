"""``str(datamodule)`` as Lightning prints it: one ``{<Stage> dataloader: ...}`` line per loader
hook, ``size=<len(dataset)>`` (``NA`` without a length) for each loader it returns (``1. size=..
; 2. size=..`` for several), ``None`` where the hook gives none or fails (not set up yet)."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sized
from typing import Any

from torch.utils.data import DataLoader

#: the line's title -> the hook that gives its loader(s)
_HOOKS = (("Train dataloader", "train_dataloader"), ("Validation dataloader", "val_dataloader"),
          ("Test dataloader", "test_dataloader"), ("Predict dataloader", "predict_dataloader"))


def _size(loader: Any) -> str:
    dataset = getattr(loader, "dataset", None)
    return str(len(dataset)) if isinstance(dataset, Sized) else "NA"


def _describe(loaders: Any) -> str:
    if loaders is None:
        return "None"
    if isinstance(loaders, DataLoader):
        return f"size={_size(loaders)}"
    items = loaders.values() if isinstance(loaders, Mapping) else loaders
    return " ; ".join(f"{i}. size={_size(d)}" if isinstance(d, DataLoader) else "None"
                      for i, d in enumerate(items, start=1))


def describe_datamodule(datamodule: Any) -> str:
    lines = []
    for title, hook in _HOOKS:
        try:
            text = _describe(getattr(datamodule, hook)())
        except Exception:  # noqa: BLE001 - not set up yet, or no such loader: Lightning says None
            text = "None"
        lines.append(f"{{{title}: {text}}}")
    return os.linesep.join(lines)
