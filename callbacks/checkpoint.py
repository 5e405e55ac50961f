"""ModelCheckpoint: periodic, best-k and last checkpoints, each written atomically."""
from __future__ import annotations

import math
import os
import shutil
from typing import Any

from .base import Callback


class ModelCheckpoint(Callback):
    """Save every ``every_n_train_steps`` optimizer steps (and at the end of fit if ``save_last``).

    With ``monitor`` set, only the ``save_top_k`` best checkpoints by that metric are kept
    (``mode`` "min" or "max"); ``save_top_k=-1`` keeps all. ``last`` always points at the newest.
    Saving is a collective: the callback runs on every rank and the Trainer writes atomically.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int | None = None,
                 save_last: bool = True, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, filename: str = "step={step:06d}") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint: mode={mode!r}; valid choices: min, max")
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"ModelCheckpoint: every_n_train_steps={every_n_train_steps!r} must be >= 1")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint: save_top_k={save_top_k!r} must be >= -1")
        self.dirpath, self.every_n_train_steps, self.save_last = dirpath, every_n_train_steps, save_last
        self.monitor, self.mode, self.save_top_k, self.filename = monitor, mode, save_top_k, filename
        self.best_k: dict[str, float] = {}  # path -> score
        self.last_path: str | None = None
        self._last_saved_step = -1

    @property
    def best_model_path(self) -> str | None:
        if not self.best_k:
            return None
        pick = min if self.mode == "min" else max
        return pick(self.best_k, key=self.best_k.get)

    def setup(self, trainer, module) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        if n and step > 0 and step % n == 0 and step != self._last_saved_step:
            self._save(trainer)

    def on_fit_end(self, trainer, module) -> None:
        if self.save_last and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def _save(self, trainer) -> None:
        self._last_saved_step = trainer.global_step
        path = os.path.join(self.dirpath, self.filename.format(step=trainer.global_step, epoch=trainer.current_epoch))
        score = None
        if self.monitor is not None:
            score = trainer.callback_metrics.get(self.monitor)
            if score is None:
                raise KeyError(f"ModelCheckpoint: monitor={self.monitor!r} was never logged; logged: "
                               f"{sorted(trainer.callback_metrics)}")
            if self.save_top_k == 0 or not self._is_top_k(score):
                path = None
        if path is not None:
            trainer.save_checkpoint(path)
            if score is not None:
                self.best_k[path] = float(score)
                self._prune(trainer, keep=path)
        if self.save_last:
            last = os.path.join(self.dirpath, "last")
            trainer.save_checkpoint(last)
            self.last_path = last

    def _is_top_k(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k) < self.save_top_k or math.isnan(score):
            return not math.isnan(score)
        worst = max(self.best_k.values()) if self.mode == "min" else min(self.best_k.values())
        return score < worst if self.mode == "min" else score > worst

    def _prune(self, trainer, keep: str) -> None:
        if self.save_top_k == -1:
            return
        while len(self.best_k) > self.save_top_k:
            pick = max if self.mode == "min" else min
            worst = pick(self.best_k, key=self.best_k.get)
            if worst == keep:
                break
            del self.best_k[worst]
            if trainer.is_global_zero:
                shutil.rmtree(worst, ignore_errors=True)
        trainer.strategy.barrier()

    def state_dict(self) -> dict[str, Any]:
        return {"best_k": dict(self.best_k), "last_path": self.last_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.last_path = state.get("last_path")
