"""Lightning's loggers for third-party services (``lightning.pytorch.loggers.comet`` / ``.mlflow`` /
``.neptune`` / ``.wandb`` / ``.litlogger``): zerotrain ships ``CSVLogger`` and ``TensorBoardLogger``
only. These names exist so that code importing them loads; constructing a logger raises
``NotImplementedError`` saying so, and each service's ``_*_AVAILABLE`` flag is False."""
from __future__ import annotations

from typing import Any

from .internals import _internal

_WHY = "zerotrain ships CSVLogger and TensorBoardLogger; subclass zerotrain.loggers.Logger for a service"

CometLogger = _internal("CometLogger", "Comet logger", why=_WHY)
MLFlowLogger = _internal("MLFlowLogger", "MLflow logger", why=_WHY)
NeptuneLogger = _internal("NeptuneLogger", "Neptune logger", why=_WHY)
WandbLogger = _internal("WandbLogger", "Weights & Biases logger", why=_WHY)
LitLogger = _internal("LitLogger", "Lightning AI logger", why=_WHY)

_COMET_AVAILABLE = _MLFLOW_AVAILABLE = _MLFLOW_SYNCHRONOUS_AVAILABLE = False
_NEPTUNE_AVAILABLE = _WANDB_AVAILABLE = _LITLOGGER_AVAILABLE = False


def _get_resolve_tags() -> Any:
    raise NotImplementedError(f"MLflow's run tags: {_WHY}")
