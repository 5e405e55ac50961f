"""``trainer._checkpoint_connector``: the few entry points of Lightning's checkpoint connector
that its public tests and helpers call, each a thin front on zerotrain's own checkpoint code
(``trainer/checkpoint/protocol.py``). Not Lightning's connector: nothing else of it is here."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_NUMBERED = "ckpt_"


class CheckpointConnector:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._ckpt_path: str | None = None
        self._user_managed = False  # zerotrain has no settable trainer.ckpt_path to manage
        self._hpc_resume_path: str | None = None  # no SLURM auto-resume: SIGUSR1 saves where README says

    def _parse_ckpt_path(self, state_fn: Any, ckpt_path: str | None, model_provided: bool,
                         model_connected: bool) -> str | None:
        """What ``ckpt_path`` means for the stage ``state_fn`` (``"fit"``, ``"validate"``, ...)."""
        from ...checkpoint.protocol import parse_ckpt_path

        return parse_ckpt_path(self.trainer, str(getattr(state_fn, "value", state_fn)), ckpt_path, model_provided,
                               model_connected)

    def restore(self, checkpoint_path: str | None = None) -> None:
        """Collective: the whole training state from ``checkpoint_path`` (weights, optimizer, loops,
        callbacks), as ``fit(ckpt_path=...)`` restores it."""
        from ...checkpoint.protocol import load

        if checkpoint_path:
            load(self.trainer, checkpoint_path)

    def dump_checkpoint(self, weights_only: bool = False) -> dict:
        """Collective: the dict a ``.ckpt`` save of the current state holds (Lightning's keys), read
        back from such a save into a scratch folder (one file: unsharded state only)."""
        import shutil
        import tempfile

        from ...checkpoint.single_file import load

        if weights_only:
            raise NotImplementedError("dump_checkpoint(weights_only=True): zerotrain's checkpoint always holds the "
                                      "training state; use ModelCheckpoint(save_weights_only=True) for the weights")
        trainer = self.trainer
        scratch = trainer.strategy.broadcast(tempfile.mkdtemp(prefix="dump_checkpoint-") if trainer.is_global_zero
                                             else None)
        try:
            path = os.path.join(scratch, "dump.ckpt")
            trainer.save_checkpoint(path)
            return load(Path(path)) if os.path.isfile(path) else {}
        finally:
            trainer.strategy.barrier()
            if trainer.is_global_zero:
                shutil.rmtree(scratch, ignore_errors=True)

    @staticmethod
    def _CheckpointConnector__max_ckpt_version_in_folder(dir_path: Any, name_key: str = _NUMBERED) -> int | None:
        """The largest number in the names holding ``name_key`` in ``dir_path`` (None: none)."""
        try:
            names = [n for n in os.listdir(dir_path) if name_key in n]
        except (FileNotFoundError, NotADirectoryError):
            return None
        numbers = [int(d) for d in (re.sub(r"\D", "", n.split(name_key)[-1]) for n in names) if d]
        return max(numbers) if numbers else None

    @staticmethod
    def _CheckpointConnector__get_max_ckpt_path_from_folder(folder_path: Any) -> str:
        top = CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(folder_path)
        return f"{folder_path}/hpc_ckpt_{top or 0}.ckpt"

    @staticmethod
    def hpc_save_path(folderpath: Any) -> str:
        """``folderpath/hpc_ckpt_<n>.ckpt``, n one more than the largest there."""
        top = CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(folderpath)
        return os.path.join(folderpath, f"hpc_ckpt_{(top or 0) + 1}.ckpt")
