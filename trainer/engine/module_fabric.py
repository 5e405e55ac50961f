"""A TrainModule set up by a Fabric (zerotrain's Engine) logs through it, as Lightning's
LightningModule does: ``self.log``/``self.log_dict`` check the values (numbers and tensors only,
no nested dicts, Lightning's messages) and hand them to the Fabric's loggers (``logger=False``:
nowhere); there is no epoch aggregation outside the Trainer."""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch


def log_through_fabric(fabric: Any, dictionary: Mapping[str, Any], logger: bool | None) -> None:
    for name, value in dictionary.items():
        if isinstance(value, Mapping):
            raise ValueError(f"`self.log_dict({dict(dictionary)})` was called, but nested dictionaries cannot be "
                             "logged")
        if not isinstance(value, (numbers.Number, torch.Tensor)):
            raise ValueError(f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot "
                             "be logged")
    if logger or logger is None:
        fabric.log_dict(metrics=dict(dictionary))
