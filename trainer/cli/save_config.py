"""``SaveConfigCallback``: the configuration a ``LightningCLI`` run was parsed with, written beside
the run (the Trainer's ``log_dir``) when the run is set up, so that it can be re-run with
``--config``."""
from __future__ import annotations

import os
from typing import Any

from ...callbacks.base import Callback
from ..utilities import is_overridden
from .parser import keep_none


class SaveConfigCallback(Callback):
    """Writes ``config`` with ``parser`` to ``<trainer.log_dir>/<config_filename>`` on global
    rank 0 at the first ``setup``. An existing file is an error (every rank raises it) unless
    ``overwrite``; ``multifile`` keeps the structure of several input config files;
    ``save_to_log_dir=False`` skips the file, for a subclass whose ``save_config`` stores the
    config elsewhere (e.g. in a logger)."""

    def __init__(self, parser: Any, config: Any, config_filename: str = "config.yaml", overwrite: bool = False,
                 multifile: bool = False, save_to_log_dir: bool = True) -> None:
        if not save_to_log_dir and not is_overridden("save_config", self, SaveConfigCallback):
            raise ValueError("`save_to_log_dir=False` only makes sense when subclassing SaveConfigCallback to "
                             "implement `save_config`: without it this callback would save nothing")
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            self._write(trainer)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        # every rank agrees, so that a later stage (test after fit) skips on all of them
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def _write(self, trainer: Any) -> None:
        log_dir = trainer.log_dir
        path = os.path.join(log_dir, self.config_filename)
        if not self.overwrite:
            exists = trainer.strategy.broadcast(os.path.isfile(path) if trainer.is_global_zero else False)
            if exists:
                raise RuntimeError(
                    f"{type(self).__name__} expected {path} to NOT exist. Aborting to avoid overwriting the results "
                    "of a previous run: delete that file, pass LightningCLI(save_config_callback=None) to save no "
                    "config, or LightningCLI(save_config_kwargs={'overwrite': True}) to overwrite it")
        if trainer.is_global_zero:
            os.makedirs(log_dir, exist_ok=True)  # no logger has written there yet
            self.parser.save(self.config, path, overwrite=self.overwrite, multifile=self.multifile, **keep_none())

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Override to store the config somewhere else too (runs on global rank 0 only, so no
        collective call here; the default does nothing)."""
