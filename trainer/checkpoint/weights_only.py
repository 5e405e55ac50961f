"""Weights-only checkpoints: ``Trainer.save_checkpoint(path, weights_only=True)``, as Lightning's.

One ``torch.save`` file at ``path`` (whatever the strategy: the state is gathered whole on global
rank 0 by ``full_state_dict``) holding Lightning's weights-only keys: ``epoch``, ``global_step``,
``pytorch-lightning_version``, ``state_dict``, ``loops`` (the loop counters), the module's and
the datamodule's hyperparameters and the datamodule's state; no optimizer, scheduler, callback or
precision state. As Lightning, the module's ``on_save_checkpoint`` sees it, the callbacks' do not.
It is not a resume point (``latest`` does not move): ``load_from_checkpoint`` reads it, and a
resume from it is Lightning's KeyError (:func:`refuse_resume`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..api import hparams
from ..loop.hooks import datamodule_hook

#: the file's ``format`` key (a resume names the file as weights only rather than unknown)
FORMAT = "zerotrain.weights/1"


def save(trainer: Any, path: str | os.PathLike) -> None:
    """Collective: every rank gives its part of the weights; global rank 0 writes ``path``
    atomically (``checkpoint_file.write``), then every rank goes on."""
    from ..version import __version__
    from .single_file import write
    from .directory import _unloadable

    if trainer.module is None:
        raise AttributeError("Saving a checkpoint is only possible if a model is attached to the Trainer. Did you "
                             "call `Trainer.save_checkpoint()` before calling `Trainer.{fit,validate,test,predict}`?")
    state_dict = trainer.strategy.full_state_dict()  # collective; complete on global rank 0 only
    error = None
    if trainer.is_global_zero:
        checkpoint: dict[str, Any] = {
            "epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "pytorch-lightning_version": __version__, "state_dict": state_dict,
            "loops": {"zerotrain": trainer.fit_loop.saved_position()}, "format": FORMAT,
            **hparams.checkpoint_entries(trainer.module, trainer.datamodule)}
        dm = trainer.datamodule
        dm_state = datamodule_hook(trainer, dm, "state_dict") if dm is not None else None
        if dm_state:
            checkpoint[type(dm).__qualname__] = dm_state
        trainer.module.on_save_checkpoint(checkpoint)  # the module's hook alone, as Lightning's weights_only
        try:
            write(Path(path), checkpoint, _unloadable)
        except (OSError, ValueError) as exc:
            error = f"rank 0: {exc}"
    error = trainer.strategy.broadcast(error)
    if error:
        from ..errors import CheckpointError

        raise CheckpointError(f"saving checkpoint {str(path)!r} failed: {error}")


def refuse_resume(checkpoint: Any) -> None:
    """A resume from a weights-only file: Lightning's KeyError (nothing to restore the optimizer from)."""
    if isinstance(checkpoint, dict) and checkpoint.get("format") == FORMAT:
        raise KeyError("Trying to restore optimizer state but checkpoint contains only the model. This is probably "
                       "due to `ModelCheckpoint.save_weights_only` being set to `True`.")
