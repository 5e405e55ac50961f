"""Loop counters, saved in every checkpoint so that a resumed run continues exactly; and what the
Trainer is doing now (Lightning's ``trainer.state.fn`` / ``.stage`` / ``.status``, not saved)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class _StrEnum(str, Enum):
    """Compares equal to its value, as Lightning's enums: ``trainer.state.fn == "fit"``."""

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, Enum) else other
        return isinstance(other, str) and self.value.lower() == other.lower()


class TrainerFn(_StrEnum):
    """The Trainer method running (Lightning's names)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(_StrEnum):
    """The loop running inside it."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.TESTING, RunningStage.SANITY_CHECKING)

    @property
    def dataloader_prefix(self) -> str | None:
        """Lightning's: the ``*_dataloader`` hook this stage's data comes from (``val`` for validation
        and the sanity check)."""
        if self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING):
            return "val"
        return self.value


class TrainerStatus(_StrEnum):
    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


@dataclass(eq=False)
class TrainerState:
    """Lightning's ``TrainerState`` (status, fn, stage); equal to any state with those values, so
    ``trainer.state == TrainerState(...)`` compares what Lightning compares."""

    status: TrainerStatus = TrainerStatus.INITIALIZING
    fn: TrainerFn | None = None
    stage: RunningStage | None = None

    def __eq__(self, other: object) -> bool:
        keys = ("status", "fn", "stage")
        if not all(hasattr(other, k) for k in keys):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in keys)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class StepState:
    """What the running optimizer step has seen over its accumulation's batches; a new one after
    each step (never saved)."""

    batch: Any = None  # the last batch trained (an optimizer that re-evaluates, LBFGS, runs it again)
    loss: Any = None  # the last loss backwarded, detached (what the optimizer_step hook's closure returns)
    backward_ran: bool = False  # a backward ran (some training_step did not return None)
    nonfinite: bool = False  # on_nonfinite="skip": a non-finite loss on this rank; the step is skipped


@dataclass
class LoopState:
    global_step: int = 0  # optimizer steps taken (skipped fp16 overflow steps included)
    skipped_steps: int = 0  # optimizer steps skipped for fp16 overflow
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed
    total_batches: int = 0  # micro-batches consumed over the whole run
    cut_batches: int = 0  # max_steps ended epoch `epoch - 1` after these micro-batches: a later fit continues it
    epoch_ended: int = 0  # saved while `epoch` ended (1; 2: max_steps cut it): a fit resumes after it; 0 while running
    # not fields (never saved): what runs now, as Lightning's TrainerState
    fn = None  # TrainerFn | None
    stage = None  # RunningStage | None
    status = TrainerStatus.INITIALIZING
    epoch_phase = 0  # 1: `epoch` is running, 2: its training is over (its on_train_epoch_end), 0: between epochs
    batch_ready = 0  # batches of `epoch` fetched, the running one included (Lightning's batch_progress.current.ready)
    epoch_cut = False  # on_train_batch_start returned -1: `epoch` ends with its running batch
    last_val_step = -1  # the global step of the last validation (-1: none ran)

    def __post_init__(self) -> None:
        self.step = StepState()  # the running optimizer step (not a field: never saved)

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status == TrainerStatus.INTERRUPTED

    def end_saved_epoch(self) -> None:
        """A fit resuming from a checkpoint saved while its epoch ended (the epoch-end validation,
        ``on_train_epoch_end``): as Lightning, that epoch is over and the fit starts the next one
        (``current_epoch`` is the next one from ``on_train_start``; validate/test keep the saved one).
        Saved in an epoch that ``max_steps`` cut, the position is the one after that fit."""
        if self.epoch_ended == 2 and not self.batches_in_epoch:  # resharded to no whole batch: it starts over
            self.epoch_ended = 0
        elif self.epoch_ended:
            self.cut_batches = self.batches_in_epoch if self.epoch_ended == 2 else 0
            self.epoch, self.batches_in_epoch, self.epoch_ended = self.epoch + 1, 0, 0

    def continue_cut_epoch(self) -> None:
        """The position after a fit that max_steps stopped mid-epoch: that epoch ended for its hooks
        and counter, as Lightning's, yet its batches are not all trained; back to it, after them."""
        if self.cut_batches:
            self.epoch, self.batches_in_epoch, self.cut_batches = self.epoch - 1, self.cut_batches, 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key in self.__dataclass_fields__:
                setattr(self, key, int(value))
