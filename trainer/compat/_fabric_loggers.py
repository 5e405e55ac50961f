"""``zerotrain.fabric.loggers`` (Lightning Fabric's ``lightning.fabric.loggers``): Fabric's
``TensorBoardLogger`` and ``CSVLogger`` take ``root_dir`` where the Trainer's take ``save_dir``;
both write ``root_dir/name/version_N`` as the Trainer's loggers do, so they are those loggers under
Fabric's signatures. ``Logger`` is zerotrain's base class.

The module's name is private (``_fabric_loggers``) so that jsonargparse, which resolves a class name
given alone (``--trainer.logger=TensorBoardLogger``) among the public subclasses, finds only the
Trainer's loggers: these subclasses share their names."""
from __future__ import annotations

import os
from typing import Any

from ...callbacks.base import Logger
from ...callbacks.loggers import CSVLogger as _CSVLogger
from ...callbacks.loggers.tensorboard import TensorBoardLogger as _TensorBoardLogger


class TensorBoardLogger(_TensorBoardLogger):
    """Fabric's ``TensorBoardLogger(root_dir, name, version, default_hp_metric, prefix, sub_dir)``."""

    def __init__(self, root_dir: "str | os.PathLike", name: str | None = "lightning_logs",
                 version: int | str | None = None, default_hp_metric: bool = True, prefix: str = "",
                 sub_dir: "str | os.PathLike | None" = None, **kwargs: Any) -> None:
        super().__init__(root_dir, name=name, version=version, default_hp_metric=default_hp_metric, prefix=prefix,
                         sub_dir=sub_dir, **kwargs)
        self._fabric_root_dir = os.fspath(root_dir)

    @property
    def root_dir(self) -> str:
        """The ``root_dir`` as given (Fabric's; the Trainer's logger's is ``save_dir/name``)."""
        return self._fabric_root_dir

    @property
    def log_dir(self) -> str:
        """``root_dir/name/version[/sub_dir]``, ``~`` and ``$VARS`` expanded, as the Trainer's logger."""
        version = self.version
        path = os.path.join(self.save_dir, self.name, version if isinstance(version, str) else f"version_{version}")
        if self.sub_dir is not None:
            path = os.path.join(path, self.sub_dir)
        return os.path.expandvars(os.path.expanduser(path))


class CSVLogger(_CSVLogger):
    """Fabric's ``CSVLogger(root_dir, name, version, prefix, flush_logs_every_n_steps)``."""

    def __init__(self, root_dir: "str | os.PathLike", name: str | None = "lightning_logs",
                 version: int | str | None = None, prefix: str = "", flush_logs_every_n_steps: int = 100) -> None:
        super().__init__(root_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)


__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
