"""ModelCheckpoint: periodic and best-k checkpoints, each written atomically, and a ``latest``
pointer to the newest."""
from __future__ import annotations

import math
import os
import re
import shutil
from typing import Any

from ..trainer.checkpoint_io import read_latest
from ..trainer.errors import CheckpointError
from .base import Callback


class ModelCheckpoint(Callback):
    """Save every ``every_n_train_steps`` optimizer steps (and at the end of fit if ``save_last``).

    Each save is a new checkpoint directory ``dirpath/filename`` (a sharded, atomically written
    directory: ``trainer/checkpoint_io.py``) and then moves the pointer ``dirpath/latest`` to it.
    Resume with ``fit(ckpt_path="latest")`` (or ``ckpt_path=dirpath``); a worker restarted by the
    elastic agent does so by itself.

    With ``monitor`` set, the ``save_top_k`` best checkpoints by that metric (``mode`` "min" or
    "max"; ``save_top_k=-1`` keeps all) are kept, and so is the one ``latest`` points to (the
    newest, which a restart needs) even when it is not among the best: it is deleted once a newer
    one replaces it. Without ``monitor`` every checkpoint is kept. Saving is a collective: the
    callback runs on every rank.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None,
                 save_last: bool = True, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, filename: str = "step={step:06d}", every_n_epochs: int | None = None,
                 save_weights_only: bool = False, auto_insert_metric_name: bool = True) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint: mode={mode!r}; valid choices: min, max")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"ModelCheckpoint: every_n_train_steps={every_n_train_steps!r} must be >= 1")
        if every_n_epochs is not None and every_n_epochs < 0:
            raise ValueError(f"ModelCheckpoint: every_n_epochs={every_n_epochs!r} must be >= 0 (0: never)")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint: save_top_k={save_top_k!r} must be >= -1")
        if "/" in filename or filename in ("latest", "last"):
            raise ValueError(f"ModelCheckpoint: filename={filename!r} must be one directory name, not "
                             "'latest' or 'last'")
        if monitor is not None and every_n_train_steps is None and every_n_epochs is None:
            every_n_epochs = 1  # Lightning's trigger for a monitored checkpoint given none
        self.dirpath, self.every_n_train_steps, self.save_last = dirpath, every_n_train_steps, save_last
        self.monitor, self.mode, self.save_top_k, self.filename = monitor, mode, save_top_k, filename
        self.every_n_epochs, self.save_weights_only = every_n_epochs, save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.best_k: dict[str, float] = {}  # path -> score, for the checkpoints this callback keeps
        self.last_path: str | None = None
        self._last_saved_step = -1
        self._epoch = 0

    @property
    def best_model_path(self) -> str | None:
        scored = {p: s for p, s in self.best_k.items() if not math.isnan(s)}
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=scored.get)

    @property
    def best_k_models(self) -> dict[str, float]:
        """Lightning's name: path -> monitored score of each checkpoint kept."""
        return self.best_k

    @property
    def best_model_score(self) -> float | None:
        best = self.best_model_path
        return self.best_k[best] if best is not None else None

    @property
    def kth_best_model_path(self) -> str | None:
        """The worst of the kept ``save_top_k`` (the next to go)."""
        kept = [p for p in self.best_k if p in self._keep() and not math.isnan(self.best_k[p])]
        if not kept:
            return None
        return (max if self.mode == "min" else min)(kept, key=self.best_k.get)

    @property
    def last_model_path(self) -> str | None:
        return self.last_path

    @property
    def latest_path(self) -> str | None:
        """The checkpoint ``dirpath/latest`` names (read from disk), or None."""
        latest = read_latest(self.dirpath) if self.dirpath else None
        return str(latest) if latest is not None else None

    def setup(self, trainer, module, stage: str | None = None) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        if n and step > 0 and step % n == 0 and step != self._last_saved_step:
            self._save(trainer)

    def on_train_epoch_start(self, trainer, module) -> None:
        self._epoch = trainer.current_epoch  # the epoch that on_train_epoch_end ends

    def on_train_epoch_end(self, trainer, module) -> None:
        n = self.every_n_epochs
        if n and (self._epoch + 1) % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def on_fit_end(self, trainer, module) -> None:
        if self.save_last and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def format_checkpoint_name(self, metrics: dict[str, float], epoch: int = 0, step: int = 0) -> str:
        """``filename`` filled in: Lightning's templates (``"{epoch}-{val_loss:.2f}"`` gives
        ``epoch=3-val_loss=0.12`` with ``auto_insert_metric_name``; a name already written before
        its brace, as in ``"step={step:06d}"``, is not written twice) and Python format specs.
        A metric not logged yet reads 0, as in Lightning. Weights-only files end in .safetensors."""
        values = {**metrics, "epoch": epoch, "step": step}

        def fill(m: re.Match) -> str:
            name, spec = m.group(1), m.group(2) or ""
            prefix = f"{name}=" if self.auto_insert_metric_name and not m.string[:m.start()].endswith(
                f"{name}=") else ""
            return prefix + format(values.get(name, 0), spec[1:])

        name = re.sub(r"\{([^{}:]+)(:[^{}]*)?\}", fill, self.filename)
        return name + ".safetensors" if self.save_weights_only else name

    def _save(self, trainer) -> None:
        self._last_saved_step = trainer.global_step
        path = os.path.join(self.dirpath, self.format_checkpoint_name(
            trainer.callback_metrics, epoch=trainer.current_epoch, step=trainer.global_step))
        if self.monitor is not None:
            score = trainer.callback_metrics.get(self.monitor)
            if score is None:
                raise KeyError(f"ModelCheckpoint: monitor={self.monitor!r} was never logged; logged: "
                               f"{sorted(trainer.callback_metrics)}")
            self.best_k[path] = float(score)  # before saving: the checkpoint's own state lists it
        try:
            if self.save_weights_only:
                self._save_weights(trainer, path)
            else:
                trainer.save_checkpoint(path)
        except CheckpointError as exc:  # name the setting that chose the path
            raise CheckpointError(f"{exc} (ModelCheckpoint dirpath={self.dirpath!r})") from exc
        self.last_path = path
        self._prune(trainer)

    def _save_weights(self, trainer, path: str) -> None:
        """Weights only, as one consolidated safetensors file (every key of the module's state
        dict at full shape, loadable by plain PyTorch): the sharded checkpoint is written to a
        scratch directory by every rank, consolidated by rank 0 one tensor at a time
        (``trainer/consolidate.py``), then removed. Not a resume point: ``latest`` does not move."""
        from ..trainer.consolidate import consolidate

        scratch = os.path.join(self.dirpath, f".{os.path.basename(path)}.shards")
        trainer.save_checkpoint(scratch, update_latest=False)
        try:
            if trainer.is_global_zero:
                consolidate(scratch, path)
        finally:
            if trainer.is_global_zero:
                shutil.rmtree(scratch, ignore_errors=True)
            trainer.strategy.barrier()

    def _keep(self) -> set[str]:
        if self.save_top_k == -1:
            return set(self.best_k)
        scored = [p for p in self.best_k if not math.isnan(self.best_k[p])]
        scored.sort(key=self.best_k.get, reverse=self.mode == "max")
        return set(scored[:self.save_top_k])

    def _prune(self, trainer) -> None:
        if self.monitor is None:
            return
        latest = os.path.abspath(self.latest_path or self.last_path or "")
        for path in sorted(set(self.best_k) - self._keep()):
            if os.path.abspath(path) == latest:
                continue  # never the one a restart would resume from
            del self.best_k[path]
            if trainer.is_global_zero:
                _remove(path)
        trainer.strategy.barrier()

    def state_dict(self) -> dict[str, Any]:
        return {"best_k": dict(self.best_k), "last_path": self.last_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.last_path = state.get("last_path")


def _remove(path: str) -> None:
    """A checkpoint directory, or a weights-only file."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
