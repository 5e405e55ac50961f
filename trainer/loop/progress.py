"""Lightning's loop objects seen from outside: ``trainer.fit_loop`` (``.epoch_progress``,
``.epoch_loop.batch_progress``, ``.epoch_loop._batches_that_stepped``, ``.max_epochs``, ``.done``,
``.epoch_loop.val_loop.batch_progress`` ...) and ``trainer.validate_loop`` / ``test_loop`` /
``predict_loop``, which Lightning documents and users read progress from.

zerotrain's Trainer runs its loop itself (``trainer/loop/trainer.py``) and keeps its own counters
(``LoopState``: epochs ended, optimizer steps, batches of the epoch and of the run). The objects
here are views of those counters with Lightning's names: reading one reads the Trainer's
counter, setting one (as Lightning's tests do to fake a position in the run) sets it. Only the
evaluation loops' batch counts are kept here, by ``EvalLoop._evaluation_step``, through which the
Trainer runs every evaluation batch. Nothing here runs the loop or decides anything the Trainer
decides; ``FitLoop.done`` applies Lightning's rule to the counters, for code that asks.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

#: the logger Lightning's fit-loop lines come from, under the name its rank-zero module has here
rank_zero_log = logging.getLogger("zerotrain.utilities.rank_zero")

_FIELDS = ("ready", "started", "processed", "completed")


class Tracker:
    """Four counts of one unit of work, as Lightning's progress trackers: how many became ready,
    started, were processed and completed."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ready = self.started = self.processed = self.completed = 0

    def increment(self, field: str) -> None:
        setattr(self, field, getattr(self, field) + 1)

    def state_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in _FIELDS}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f)}' for f in _FIELDS)})"


class Progress:
    """``current`` (this run of the loop) and ``total`` (every run) counts."""

    def __init__(self, current: Any = None, total: Any = None) -> None:
        self.current = current if current is not None else Tracker()
        self.total = total if total is not None else Tracker()

    def reset(self) -> None:
        self.current.reset()
        self.total.reset()

    def reset_on_run(self) -> None:
        self.current.reset()

    def increment(self, field: str) -> None:
        self.current.increment(field)
        self.total.increment(field)

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {"current": self.current.state_dict(), "total": self.total.state_dict()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(current={self.current!r}, total={self.total!r})"


class LinkedTracker:
    """A ``Tracker`` whose counts are the Trainer's own: ``get(field)`` reads one, ``set(field,
    value)`` writes it."""

    def __init__(self, get: Callable[[str], int], set: Callable[[str, int], None]) -> None:
        object.__setattr__(self, "_get", get)
        object.__setattr__(self, "_set", set)

    def __getattr__(self, name: str) -> int:
        if name in _FIELDS:
            return self._get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: int) -> None:
        if name not in _FIELDS:
            raise AttributeError(f"{type(self).__name__}: {name!r} is no progress count; valid: {', '.join(_FIELDS)}")
        self._set(name, int(value))

    def state_dict(self) -> dict[str, int]:
        return {f: self._get(f) for f in _FIELDS}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={self._get(f)}' for f in _FIELDS)})"


def _attribute(owner: Callable[[Any], Any], name: str, doc: str) -> property:
    """A property reading and setting ``owner(self).<name>``."""
    return property(lambda self: getattr(owner(self), name), lambda self, v: setattr(owner(self), name, v), doc=doc)


class EvalLoop:
    """Lightning's ``_EvaluationLoop`` seen from outside: ``batch_progress`` (``current``: the batches
    of the running or last evaluation; ``total``: of the training epoch, in ``fit``, or of every
    run of this stage) and ``_max_batches`` (the per-loader batch counts). The Trainer runs each
    evaluation batch through ``_evaluation_step``, which counts it."""

    def __init__(self, trainer: Any, stage: str) -> None:
        self.trainer, self.stage = trainer, stage
        self.batch_progress = Progress()
        #: predict: the running batch's dataset indices, and every batch's per loader (trainer/data/predict_indices.py)
        self.current_batch_indices: list[int] = []
        self.epoch_batch_indices: list[list[list[int]]] = []

    def _evaluation_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None, step: Callable[[], Any]) -> Any:
        """One evaluation batch: ``step()`` runs its hooks and the module's step; returns what it returns."""
        for field in ("ready", "started"):
            self.batch_progress.increment(field)
        out = step()
        for field in ("processed", "completed"):
            self.batch_progress.increment(field)
        return out

    _counts = {"validate": "num_val_batches", "test": "num_test_batches", "predict": "num_predict_batches"}
    _max_batches = property(lambda self: getattr(self.trainer, self._counts[self.stage]),
                            lambda self, v: setattr(self.trainer, self._counts[self.stage], list(v)),
                            doc="The batches of each loader the (last) evaluation runs (Lightning's ``_max_batches``).")

    @property
    def inference_mode(self) -> bool:
        return bool(self.trainer.inference_mode)

    def setup_data(self) -> None:
        """Lightning's ``val_loop.setup_data()`` in ``fit``: request the validation loaders again
        now, from the datamodule or the module (loaders passed to ``fit`` are kept): the
        batch-size finder's new ``batch_size``."""
        t = self.trainer
        if self.stage == "validate" and t._val_given is None:
            t._val_pending = True
            t._fit_val_loaders()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.stage!r}, batch_progress={self.batch_progress!r})"


class _OptimizerProgress:
    """``optim_progress.optimizer.step``: the optimizer steps taken (``trainer.global_step``)."""

    def __init__(self, state: Any) -> None:
        self._state = state
        step = LinkedTracker(self._get, self._set)
        self.step = Progress(step, step)

    def _get(self, field: str) -> int:
        return self._state.global_step

    def _set(self, field: str, value: int) -> None:
        self._state.global_step = value


class _Optimization:
    """``epoch_loop.automatic_optimization`` / ``manual_optimization``: their step counts."""

    def __init__(self, state: Any) -> None:
        self.optim_progress = self  # automatic: ``optim_progress.optimizer.step``
        self.optimizer = _OptimizerProgress(state)
        self.optim_step_progress = self.optimizer.step  # manual: ``optim_step_progress``
        self._state = state

    @property
    def optimizer_steps(self) -> int:
        return self._state.global_step


class EpochLoop:
    """Lightning's ``_TrainingEpochLoop`` seen from outside: ``batch_progress`` (``current``: the
    batches of this epoch, ``total``: of the run), ``global_step``, ``max_steps``/``min_steps`` (the
    Trainer's), ``_batches_that_stepped`` (the step the loggers see), ``val_loop``."""

    #: Lightning's flag of a loop reloaded from a checkpoint mid-run: False here, the Trainer's
    #: loop keeps no such state (a resume starts from the loaded counters)
    restarting = False

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        st = trainer.state
        self.batch_progress = Progress(LinkedTracker(self._current, self._set_current),
                                       LinkedTracker(self._total, self._set_total))
        self.automatic_optimization = self.manual_optimization = _Optimization(st)
        self.val_loop = EvalLoop(trainer, "validate")

    # batches: a batch is ready/started from when it is fetched, processed/completed once trained
    def _trained(self) -> int:
        """The batches of this epoch trained (of the last one, between epochs: the Trainer starts its
        count over at an epoch's end, Lightning at the next epoch's start)."""
        st = self.trainer.state
        if st.epoch_phase:
            return st.batches_in_epoch
        return max(st.batches_in_epoch, st.batch_ready - int(st.epoch_cut))

    def _current(self, field: str) -> int:
        trained = self._trained()
        return max(self.trainer.state.batch_ready, trained) if field in ("ready", "started") else trained

    def _set_current(self, field: str, value: int) -> None:
        setattr(self.trainer.state, "batch_ready" if field in ("ready", "started") else "batches_in_epoch", value)

    def _total(self, field: str) -> int:
        in_flight = self._current("ready") - self._trained() if field in ("ready", "started") else 0
        return self.trainer.state.total_batches + in_flight

    def _set_total(self, field: str, value: int) -> None:
        self.trainer.state.total_batches = value

    @property
    def batch_idx(self) -> int:
        """The index of the running (or last) training batch in its epoch."""
        return self.batch_progress.current.ready - 1

    @property
    def total_batch_idx(self) -> int:
        return self.batch_progress.total.ready - 1

    @property
    def global_step(self) -> int:
        return self.trainer.state.global_step

    max_steps = _attribute(lambda self: self.trainer, "max_steps", "The Trainer's ``max_steps``.")
    min_steps = _attribute(lambda self: self.trainer, "min_steps", "The Trainer's ``min_steps``.")

    @property
    def _batches_that_stepped(self) -> int:
        return self.trainer._logging.logging_step

    @_batches_that_stepped.setter
    def _batches_that_stepped(self, value: int) -> None:
        self.trainer._logging.logging_step = int(value)

    def _get_monitor_value(self, key: str) -> Any:
        """The metric a ReduceLROnPlateau scheduler is stepped with (the Trainer asks here)."""
        return self.trainer.callback_metrics.get(key)

    def _should_check_val_epoch(self) -> bool:
        return bool(self.trainer.enable_validation) and self.trainer._validates_this_epoch()

    def _should_accumulate(self) -> bool:
        """The running batch does not end an accumulation (its gradients are kept for the next)."""
        t, ready = self.trainer, self.trainer.state.batch_ready
        return ready % t.accumulate_grad_batches != 0 and ready < t.num_training_batches


class FitLoop:
    """Lightning's ``_FitLoop`` seen from outside (``trainer.fit_loop``): ``epoch_progress`` (its
    ``completed`` is ``trainer.current_epoch``; ``processed`` is one more from the end of an
    epoch's training to its ``on_train_epoch_end``; ``ready``/``started`` one more while an epoch
    runs), ``max_epochs``/``min_epochs``/``max_steps``/``min_steps`` (the Trainer's; settable),
    ``max_batches`` (``trainer.num_training_batches``), ``done``, ``epoch_loop``."""

    #: a callback runs the training steps' forwards only: no backward, no zero_grad (the
    #: StochasticWeightAveraging's batch-norm epoch; Lightning's ``fit_loop._skip_backward``)
    skip_backward = False
    restarting = False  # as EpochLoop.restarting
    _skip_backward = property(lambda self: self.skip_backward,
                              lambda self, value: setattr(self, "skip_backward", bool(value)))

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        epochs = LinkedTracker(self._epochs, self._set_epochs)
        self.epoch_progress = Progress(epochs, epochs)
        self.epoch_loop = EpochLoop(trainer)

    def _epochs(self, field: str) -> int:
        st = self.trainer.state
        extra = {"ready": st.epoch_phase >= 1, "started": st.epoch_phase >= 1, "processed": st.epoch_phase >= 2}
        return st.epoch + int(extra.get(field, False))

    def _set_epochs(self, field: str, value: int) -> None:
        st = self.trainer.state
        st.epoch, st.epoch_phase = value, 0

    max_epochs = _attribute(lambda self: self.trainer, "max_epochs", "The Trainer's ``max_epochs``.")
    min_epochs = _attribute(lambda self: self.trainer, "min_epochs", "The Trainer's ``min_epochs``.")
    max_steps = _attribute(lambda self: self.trainer, "max_steps", "The Trainer's ``max_steps``.")
    min_steps = _attribute(lambda self: self.trainer, "min_steps", "The Trainer's ``min_steps``.")
    max_batches = _attribute(lambda self: self.trainer, "num_training_batches",
                             "The training batches of an epoch (``trainer.num_training_batches``).")

    @property
    def batch_idx(self) -> int:
        return self.epoch_loop.batch_idx

    @property
    def total_batch_idx(self) -> int:
        return self.epoch_loop.total_batch_idx

    @property
    def _can_stop_early(self) -> bool:
        """A requested stop may end the run: ``min_epochs`` epochs processed, ``min_steps`` steps taken."""
        epochs_ok = not self.min_epochs or self.epoch_progress.current.processed >= self.min_epochs
        return epochs_ok and (not self.min_steps or self.trainer.state.global_step >= self.min_steps)

    @property
    def done(self) -> bool:
        """Lightning's rule for leaving the fit loop, on the counters as they are now (said as its
        lines say it: info, the stop request at debug level)."""
        if self.max_batches == 0:
            rank_zero_log.info("`Trainer.fit` stopped: No training batches.")
            return True
        if self.max_steps not in (None, -1) and self.trainer.state.global_step >= self.max_steps:
            rank_zero_log.info("`Trainer.fit` stopped: `max_steps=%r` reached.", self.max_steps)
            return True
        if self.max_epochs not in (None, -1) and self.epoch_progress.current.processed >= self.max_epochs:
            rank_zero_log.info("`Trainer.fit` stopped: `max_epochs=%r` reached.", self.max_epochs)
            return True
        if self.trainer.should_stop and self._can_stop_early:
            rank_zero_log.debug("`Trainer.fit` stopped: `trainer.should_stop` was set.")
            return True
        return False

    def _should_accumulate(self) -> bool:
        return self.epoch_loop._should_accumulate()

    def saved_position(self) -> dict:
        """The loop state a checkpoint holds: the state, marked ``epoch_ended`` when saved while the
        running epoch ends (its last batch trained: its validation or ``on_train_batch_end``; or in
        ``on_train_epoch_end``): 2 where ``max_steps`` cut it short, else 1 (``LoopState.end_saved_epoch``)."""
        trainer, st = self.trainer, self.trainer.state
        out = st.state_dict()
        if st.epoch_phase == 2:
            out["epoch_ended"] = 2 if trainer._max_steps_reached() and not trainer._epoch_complete() else 1
        elif st.epoch_phase == 1 and trainer.fitting and st.batches_in_epoch >= (trainer.num_training_batches or 0) > 0:
            out["epoch_ended"] = 1
        return out

    def end_saved_epoch(self) -> None:
        """Before ``on_train_start``: a checkpoint saved while its epoch ended resumes in the next
        epoch (``LoopState.end_saved_epoch``), except where this fit has ``max_steps``: Lightning's
        iteration-based training keeps the saved ``current_epoch`` in ``on_train_start`` (then
        ``continue_cut_epoch`` moves on)."""
        if self.max_steps in (None, -1):
            self.trainer.state.end_saved_epoch()

    def continue_cut_epoch(self) -> None:
        """A fit after one that max_steps stopped mid-epoch (resumed from its checkpoint, or the same
        Trainer again): that epoch ended for its hooks and counter, as Lightning's, yet its batches
        are not all trained; it continues where it stopped, so the run is the one it would have been."""
        self.trainer.state.end_saved_epoch()
        self.trainer.state.continue_cut_epoch()

    def start_epoch(self) -> int:
        """The Trainer begins an epoch: its batch counts start over (from the batches already trained
        when resuming mid-epoch: returned) and so do the epoch's validation batch counts."""
        st = self.trainer.state
        st.epoch_phase, st.batch_ready, st.epoch_cut = 1, st.batches_in_epoch, False
        self.epoch_loop.val_loop.batch_progress.total.reset()
        return st.batches_in_epoch

    @property
    def loaders_given(self) -> bool:
        """The training loaders were passed to ``fit`` (not requested from the datamodule or module)."""
        return bool(self.trainer._fit_loaders_given)

    def run(self) -> None:
        """Lightning's ``fit_loop.run()``: the running fit's training (its loader requested if not
        yet), from ``on_train_start`` to ``on_train_end``. The tuners (``callbacks/tuning/``) run
        their trial steps with it inside ``on_fit_start``."""
        self.trainer._require_train_loader()
        self.trainer._fit_loop()

    def setup_data(self) -> None:
        """Request fit's training loader again, from the datamodule or the module (loaders passed
        to ``fit`` are kept): the batch-size finder's new ``batch_size``; ``num_training_batches``
        is its batches after ``limit_train_batches``/``overfit_batches``, as the epoch will run."""
        t = self.trainer
        if t.limit_train_batches == 0:  # Lightning asks for no training data then
            t.num_training_batches = 0
            return
        if not t._fit_loaders_given:
            t._train_source, t.train_dataloader = None, None
        t._require_train_loader()
        t.num_training_batches = t._limit(t._train_loader, t.limit_train_batches)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(epoch_progress={self.epoch_progress!r}, max_epochs={self.max_epochs!r})"


class TrainerLoops:
    """The Trainer's loop views (a mixin of :class:`~.trainer.Trainer`), made on first use."""

    def _loop_view(self, name: str, make: Callable[[], Any]) -> Any:
        views = self.__dict__.setdefault("_loop_views", {})
        if name not in views:
            views[name] = make()
        return views[name]

    @property
    def fit_loop(self) -> FitLoop:
        return self._loop_view("fit", lambda: FitLoop(self))

    @property
    def validate_loop(self) -> EvalLoop:
        return self._loop_view("validate", lambda: EvalLoop(self, "validate"))

    @property
    def test_loop(self) -> EvalLoop:
        return self._loop_view("test", lambda: EvalLoop(self, "test"))

    @property
    def predict_loop(self) -> EvalLoop:
        return self._loop_view("predict", lambda: EvalLoop(self, "predict"))

    def _eval_loop(self, fn: str) -> EvalLoop:
        """The loop view counting an evaluation of ``fn``: inside ``fit`` (and its sanity check) the
        fit loop's ``val_loop``, else the stage's own."""
        if fn == "validate" and self.state.fn == "fit":
            return self.fit_loop.epoch_loop.val_loop
        return getattr(self, f"{fn}_loop")

    @property
    def enable_validation(self) -> bool:
        """Validation runs during ``fit``: validation data is there (or will be requested), the module
        has a ``validation_step`` and ``limit_val_batches`` is not 0 (Lightning's rule)."""
        has_data = self.val_dataloader is not None or bool(getattr(self, "_val_pending", False))
        return self.module is not None and has_data and self._validation_defined() and self.limit_val_batches != 0

    val_check_batch: float | None = None  # set at the start of fit's training (trainer/data/loaders.py)
