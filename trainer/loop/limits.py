"""When the training loop stops and where it validates: ``max_epochs`` (-1 or None: no limit),
``max_steps`` (-1: no limit), a ``should_stop`` held back by ``min_epochs``/``min_steps``, and
``check_val_every_n_epoch`` (a mixin of :class:`~.trainer.Trainer`, as Lightning's fit loop's
``done`` and ``_should_check_val_epoch``)."""
from __future__ import annotations

import logging
import math
import time
from typing import Any

log = logging.getLogger("zerotrain")
#: the logger Lightning's own lines of the fit loop come from (ported tests capture it by name)
trainer_log = logging.getLogger("zerotrain.trainer.trainer")  # Lightning's name, renamed: not our module path

#: what a limit of exactly one (the int 1 or the float 1.0) means, said at construction as Lightning
#: does, since 1 (one batch) and 1.0 (every batch) are easy to confuse
_ONE_MEANS = {
    "limit_train_batches": ("1 batch per epoch will be used.", "100% of the batches per epoch will be used."),
    "val_check_interval": ("validation will run after every batch.",
                           "validation will run at the end of the training epoch."),
}
_ONE_MEANS_OTHER = ("1 batch will be used.", "100% of the batches will be used.")


def announce_limits(fast_dev_run: Any, **given: Any) -> None:
    """Lightning's info line for each limit set to exactly 1 or 1.0 by the user (None: not said;
    under ``fast_dev_run``, which sets the limits itself, only ``overfit_batches``)."""
    for name, value in given.items():
        if (fast_dev_run and name != "overfit_batches") or isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1:
            continue
        whole = isinstance(value, float)
        what = _ONE_MEANS.get(name, _ONE_MEANS_OTHER)[whole]
        log.info("`Trainer(%s=%r)` was configured so %s", name, value, what)


def no_training(trainer: Any) -> bool:
    """Lightning's skipped fit loop: nothing to train (``max_epochs=0``, ``max_steps=0`` or
    ``limit_train_batches=0``), so no training hooks run; the sanity check still does."""
    return trainer.max_epochs == 0 or trainer.max_steps == 0 or trainer.limit_train_batches == 0


def check_resumed_epoch(trainer: Any) -> None:
    """A fit resumed past its ``max_epochs`` is Lightning's MisconfigurationException (in its
    words), not a run that trains nothing."""
    from ..errors import MisconfigurationException

    if trainer.max_epochs not in (None, -1) and trainer.current_epoch > trainer.max_epochs:
        raise MisconfigurationException(f"You restored a checkpoint with current_epoch={trainer.current_epoch}, but "
                                        f"you have set Trainer(max_epochs={trainer.max_epochs}).")


class TrainerLimits:
    """The fit loop's stopping conditions."""

    def _done(self) -> bool:
        st = self.state
        if self.should_stop and self._can_stop_early():
            return True
        if self._max_steps_reached():
            return True
        return self.max_epochs not in (None, -1) and st.epoch >= self.max_epochs

    def _max_steps_reached(self) -> bool:
        return self.max_steps != -1 and self.state.global_step >= self.max_steps

    def _can_stop_early(self) -> bool:
        """Lightning's ``min_epochs``/``min_steps``: a ``should_stop`` (EarlyStopping, Timer) is only
        honoured once this many epochs have ended and steps were taken; until then training goes
        on and the stop stays requested, so it ends at the first step boundary where both are met."""
        st = self.state
        met = st.epoch >= (self.min_epochs or 0) and st.global_step >= (self.min_steps or 0)
        if not met and not self._said_min:
            self._said_min = True
            trainer_log.info("Trainer was signaled to stop but the required `min_epochs=%r` or `min_steps=%r` has not "
                             "been met. Training will continue...", self.min_epochs, self.min_steps)
        return met

    _said_min = False

    def _validates_this_epoch(self) -> bool:
        """``check_val_every_n_epoch``: validation runs in every n-th epoch only (None: every epoch,
        the batches of the whole run counted by ``val_check_interval``)."""
        n = self.check_val_every_n_epoch
        has_val = self.val_dataloader is not None or self._val_pending  # not yet requested: Lightning's loop asks then
        return has_val and (n is None or (self.state.epoch + 1) % n == 0)

    _val_check_time: float | None = None  # a time-based val_check_interval, in seconds
    _last_val_time = 0.0

    def _validation_due(self, val_batch: float | None, batch_idx: int) -> bool:
        """After a training batch, Lightning's rule: in an epoch that validates, when a stop is
        requested that may end the run now, once its time passed since the last validation
        (time-based; every rank decides together: one small all-reduce per batch, only then), else
        every ``val_batch`` batches of the epoch (of the run with ``check_val_every_n_epoch=None``),
        or at the last batch of a loader without a length."""
        if not self._validates_this_epoch():
            return False
        if self.should_stop and self._can_stop_early():
            return True
        if self._val_check_time is not None:
            late = time.monotonic() - self._last_val_time >= self._val_check_time
            return bool(self._strategy.any_rank(late))
        if val_batch == math.inf:
            return bool(self.is_last_batch)
        done = self.state.total_batches if self.check_val_every_n_epoch is None else batch_idx + 1
        return done % val_batch == 0

