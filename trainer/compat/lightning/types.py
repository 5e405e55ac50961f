"""Lightning's type names (``lightning.pytorch.utilities.types``, ``lightning.fabric.utilities.types``)
that ported code annotates with or checks against."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Protocol, Union, runtime_checkable

import torch

from ...optim.optimizer_config import LRSchedulerConfig  # noqa: F401  (Lightning's name, zerotrain's class)

#: what a ``*_step`` may return
STEP_OUTPUT = Optional[Union[torch.Tensor, Mapping[str, Any]]]
#: a local path
_PATH = Union[str, Path, os.PathLike]
LRSchedulerTypeUnion = Union[torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau]


@runtime_checkable
class _Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
