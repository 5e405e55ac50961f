"""A tqdm progress bar on global rank 0: step, loss, it/s, tokens/s and ETA."""
from __future__ import annotations

import sys
import time

from .base import Callback


class ProgressBar(Callback):
    def __init__(self, refresh_every: int = 1) -> None:
        self.refresh_every = refresh_every
        self._bar = None
        self._t0 = 0.0
        self._step0 = 0

    def on_fit_start(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        from tqdm import tqdm

        total = trainer.max_steps if trainer.max_steps != -1 else None
        self._bar = tqdm(total=total, initial=trainer.global_step, desc="train", dynamic_ncols=True,
                         file=sys.stderr, unit="step")
        self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        bar = self._bar
        if bar is None or trainer.global_step == bar.n or trainer.global_step % self.refresh_every:
            return
        bar.update(trainer.global_step - bar.n)
        postfix = {k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()}
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if hasattr(loss, "detach") and "loss" not in postfix:  # the step's loss, shown (not a logged metric)
            postfix["loss"] = f"{float(loss.detach()):.4g}"
        tps = module.tokens_per_sample()
        elapsed = time.perf_counter() - self._t0
        if tps and elapsed > 0 and getattr(trainer.train_dataloader, "batch_size", None):
            steps = trainer.global_step - self._step0
            tokens = steps * trainer.accumulate_grad_batches * trainer.train_dataloader.batch_size * tps
            postfix["tok/s"] = f"{tokens * trainer.strategy.data_parallel_world_size / elapsed:.0f}"
        bar.set_postfix(postfix, refresh=False)

    def on_validation_epoch_end(self, trainer, module) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in trainer.progress_bar_metrics.items()})

    def teardown(self, trainer, module, stage: str | None = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


#: Lightning's name for its tqdm progress bar (``lightning.pytorch.callbacks.TQDMProgressBar``)
TQDMProgressBar = ProgressBar
