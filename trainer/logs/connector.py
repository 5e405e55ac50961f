"""``self.log`` with pytorch-lightning 2.x's semantics: which hooks may log and their defaults, the
per-step and per-epoch values (epoch means weighted by batch size), the ``_step``/``_epoch``
names, ``sync_dist`` over ranks, ``trainer.callback_metrics`` / ``logged_metrics`` /
``progress_bar_metrics``, and what the loggers receive at which step.

Three pieces: ``_Result`` (one logged name: its running value) and ``ResultCollection`` (every
name logged in one loop: training, or evaluation), both in ``trainer/logs/results.py`` with the rules of
one ``self.log`` call; and here ``MetricsConnector`` (the Trainer's side: which collection is
active, the three metric dicts, and when rows go to the loggers). The Trainer calls the connector
at Lightning's points of the loop; nothing here knows the strategy but its ``reduce``.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

from ..errors import ConfigError
from .results import Meta, ResultCollection, as_value, log_levels, reduce_name, warn_once
from ..utilities import PossibleUserWarning, rank_zero_warn


class MetricsConnector:
    """The Trainer's metrics: the active loop's ``ResultCollection``, the metric dicts it feeds,
    and the rows sent to the loggers. ``logging_step`` is Lightning's ``_batches_that_stepped``:
    the step the loggers see, which moves after a batch's validation, not at the optimizer step."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.train = ResultCollection(True, self._sync, self._distributed)
        self.eval = ResultCollection(False, self._sync, self._distributed)
        self.active: ResultCollection | None = None
        self.fx: str | None = None  # the hook or step running now (``hook_scope``)
        self.first_iter: bool | None = None  # None: no batch yet; True: the first; False: later ones
        self.current_fx: str | None = None
        self.logging_step = 0
        self._stepped = False  # the last training batch stepped: the logging step moves at the next one
        self.callback: dict[str, torch.Tensor] = {}
        self.logged: dict[str, torch.Tensor] = {}
        self.pbar: dict[str, float] = {}
        self.seen: dict[int, int] = {}
        #: ``self.log`` calls so far: a step compares it before and after to know it logged something
        self.log_calls = 0

    # ---- self.log
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None, metric_attribute: str | None = None,
            rank_zero_only: bool = False, fx: str | None = None) -> None:
        """``TrainModule.log``: Lightning's checks, defaults and bookkeeping (see the module doc), in
        the running hook's name (else ``fx``, the module's ``_current_fx_name``, set by hand). Under
        ``barebones`` nothing is logged, with a warning, as Lightning."""
        if self.trainer.barebones:
            rank_zero_warn("self.log() does nothing here: `Trainer(barebones=True)` is configured, and it turns "
                           "logging off (logging costs speed)")
            return
        self.log_calls += 1
        value = as_value(name, value, self._device())
        fx = self.fx or fx
        on_step, on_epoch = log_levels(fx, on_step, on_epoch)
        if add_dataloader_idx and "/dataloader_idx_" in name:
            raise ConfigError(f"You called `self.log` with the key `{name}` but it should not contain information "
                              "about `dataloader_idx` when `add_dataloader_idx=True`")
        if self.active is None:
            self.active = self._for_stage()
        results = self.active
        if results is None:
            raise ConfigError(f"self.log({name!r}): no loop is running (predict logs nothing, as Lightning)")
        if self.current_fx != fx and self.first_iter in (None, True):
            results.reset(fx=fx)  # a new epoch of this hook: forget the previous one's values
        if logger and not self.trainer.loggers:
            warn_once(f"You called self.log({name!r}, ..., logger=True) but have no logger configured.")
        meta = Meta(fx, name, bool(prog_bar), logger is not False, on_step, on_epoch, reduce_name(reduce_fx),
                    bool(enable_graph), bool(add_dataloader_idx), None,
                    bool(sync_dist) and self._distributed(), sync_dist_group, bool(rank_zero_only))
        results.log(meta, value if enable_graph else value.detach(), batch_size)
        self.current_fx = fx

    def _for_stage(self) -> ResultCollection | None:
        """Outside the loop's own calls (a hook called by hand, as Lightning's tests do): the
        results of the stage ``trainer.state.stage`` says is running, if any."""
        stage = getattr(getattr(self.trainer, "state", None), "stage", None)
        if stage is None or getattr(stage, "value", stage) == "predict":
            return None
        return self.train if getattr(stage, "value", stage) == "train" else self.eval

    def _device(self) -> torch.device | None:
        module = getattr(self.trainer, "module", None)
        p = next(iter(module.parameters()), None) if module is not None else None
        return p.device if p is not None else None

    def _distributed(self) -> bool:
        return bool(getattr(self.trainer.strategy, "distributed", False))

    def _sync(self, value: torch.Tensor, meta: Meta) -> torch.Tensor:
        """``sync_dist``: the reduction over ranks that matches ``reduce_fx`` (a collective: every
        rank must log the same names in the same order)."""
        if not meta.sync or meta.rank_zero_only:
            return value
        op = meta.reduce
        if meta.sync_group is not None:
            return _reduce_in_group(value, op, meta.sync_group)
        s = self.trainer.strategy
        if op == "min":
            return -s.reduce(-value, op="max")
        return s.reduce(value, op=op)

    # ---- the three dicts, as Lightning's properties: the active loop's current values merged in
    def _merged(self, kind: str, into: dict) -> dict:
        if self.active is not None:
            into.update(self._current()[kind])
        return into

    def _current(self) -> dict[str, dict[str, Any]]:
        return self.active.metrics(on_step=self.first_iter is not None)

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self._merged("callback", self.callback)

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        return self._merged("log", self.logged)

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self._merged("pbar", self.pbar)

    def _publish(self) -> dict[str, dict[str, Any]]:
        metrics = self._current()
        self.pbar.update(metrics["pbar"])
        self.callback.update(metrics["callback"])
        self.logged.update(metrics["log"])
        return metrics

    # ---- the loop's points (Lightning's LoggerConnector)
    def reset_metrics(self) -> None:
        """At the start of every fit / validate / test and around the sanity check."""
        self.callback, self.logged, self.pbar = {}, {}, {}
        self.seen: dict[int, int] = {}  # evaluation batches logged per loader, the rows' step: over a whole fit
        self.train.reset()
        self.eval.reset()
        self.first_iter = self.current_fx = None

    def start_training(self, n_batches: float) -> None:
        """The fit loop starts; Lightning's warning when an epoch is shorter than the logging
        interval (its step values would never reach the loggers)."""
        self.active = self.train
        t = self.trainer
        every = t.log_every_n_steps
        if t.loggers and every and n_batches < every and t.is_global_zero and not t.fast_dev_run:  # as Lightning
            rank_zero_warn(f"The number of training batches ({n_batches}) is smaller than the logging interval "
                           f"Trainer(log_every_n_steps={every}). Set a lower value for log_every_n_steps if you want "
                           "to see logs for the training epoch.", PossibleUserWarning)

    def stop(self) -> None:
        """A stage ended: the dicts keep their values; nothing is active."""
        self._advance()
        self.active = None
        self.first_iter = self.current_fx = None

    def on_batch_start(self, batch: Any, dataloader_idx: int | None = None) -> None:
        if self.active is self.train:
            self._advance()
        self.first_iter = self.first_iter is None
        results = self.active
        results.batch, results.batch_size, results.dataloader_idx = batch, None, dataloader_idx

    def on_batch_end(self) -> None:
        self._publish()
        self.active.batch = self.active.batch_size = None

    def epoch_end_reached(self) -> None:
        self.first_iter = None

    def on_epoch_end(self) -> None:
        self._publish()
        self.current_fx = None

    def update_train_step_metrics(self, accumulating: bool) -> None:
        """After a batch's ``on_train_batch_end``: the step values to the loggers every
        ``log_every_n_steps`` optimizer steps (or when stopping), at ``logging_step``."""
        if not accumulating and self.step_row_due():
            self.log_metrics(self._current()["log"])

    @property
    def should_update_logs(self) -> bool:
        """Lightning's name: whether this training step's values go to the loggers (``step_row_due``)."""
        return self.step_row_due()

    def step_row_due(self) -> bool:
        """Whether the optimizer step now running (or about to) is a logging step: every
        ``log_every_n_steps``-th, or the last when stopping (Lightning's ``should_update_logs``)."""
        t = self.trainer
        return bool(t.log_every_n_steps) and ((self.logging_step + 1) % t.log_every_n_steps == 0 or t.should_stop)

    def batch_done(self, stepped: bool) -> None:
        """The end of a training batch that stepped the optimizer (or every batch, in manual
        optimization). The logging step moves on before the next batch or the epoch's end rows,
        so that a validation after this batch, at the epoch's end too, logs at the step before
        (Lightning's ``_batches_that_stepped``, incremented after the batch's validation)."""
        self._stepped = self._stepped or stepped

    def _advance(self) -> None:
        if self._stepped:
            self.logging_step += 1
            self._stepped = False

    def update_train_epoch_metrics(self) -> None:
        """After ``on_train_epoch_end``: the epoch values at the epoch's last step, then the
        training results start over."""
        self._advance()
        self.logging_step -= 1
        try:
            self.log_metrics(self._current()["log"])
        finally:
            self.logging_step += 1
        self.train.reset()
        self.first_iter = self.current_fx = None

    # ---- evaluation
    @contextlib.contextmanager
    def evaluation(self) -> Iterator[list]:
        """One evaluation run (inside fit or alone): its own results, the training's batch state
        kept aside; yields the list the per-loader outputs go into."""
        kept = self.active, self.first_iter
        self.active, self.first_iter, self.current_fx = self.eval, None, None
        try:
            yield []
        finally:
            self.eval.reset()
            self.eval.dataloader_idx = None
            self.active, self.first_iter = kept
            self.current_fx = None

    def update_eval_step_metrics(self, loader: int) -> None:
        """After an evaluation batch: its step values, at the count of batches this loader
        logged so far (in fit: over all its validations, as Lightning)."""
        if not self.trainer.sanity_checking:
            step = self.seen.get(loader, 0)
            self.log_metrics(self._current()["log"], step=step)
            self.seen[loader] = step + 1

    def store_loader_outputs(self, outputs: list) -> None:
        """After one loader of an evaluation: its epoch values (the dict ``validate``/``test``
        return for it)."""
        self.epoch_end_reached()
        outputs.append(self.update_eval_epoch_metrics())

    def update_eval_epoch_metrics(self) -> dict[str, torch.Tensor]:
        if self.trainer.sanity_checking:
            return {}
        return self._publish()["log"]

    def eval_epoch_end_reached(self) -> None:
        """Before ``on_<stage>_epoch_end``: what it logs belongs to no loader."""
        self.epoch_end_reached()
        self.active.dataloader_idx = None

    def eval_epoch_end(self, outputs: list) -> list[dict[str, float]]:
        """After ``on_<stage>_epoch_end``: what was logged there joins every loader's outputs, all
        go to the loggers as one row; returns the outputs as numbers (Lightning's return value)."""
        end = self.update_eval_epoch_metrics()
        merged: dict[str, torch.Tensor] = {}
        for out in outputs:
            merged.update(out)
            out.update(end)
        merged.update(end)
        if not self.trainer.sanity_checking:
            self.log_metrics(merged)
        return [{k: v.item() for k, v in out.items()} for out in outputs]

    # ---- the loggers
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Lightning's ``log_metrics``: numbers to every logger with the logging step (and
        ``epoch``) unless a step is given, each logger saved after; global rank 0 only."""
        t = self.trainer
        if not t.loggers or not metrics:
            return
        self.logged.update(metrics)
        if not t.is_global_zero:
            return
        row = {k: v.item() if torch.is_tensor(v) else v for k, v in metrics.items()}
        if step is None:
            step = int(row.pop("step")) if "step" in row else None
        if step is None:
            row.setdefault("epoch", t.current_epoch)
            step = self.logging_step
        for lg in t.loggers:
            lg.log_metrics(metrics=row, step=step)
            lg.save()


    def log_loss(self, name: str, loss: torch.Tensor) -> None:
        """As Lightning, a step's returned loss is not logged: only what ``self.log`` logs is. The
        exception is a strategy that runs its own schedule (the pipeline): the module's step never
        runs there, so nothing else could log the loss; it is logged as ``train_loss`` (per step) /
        ``val_loss`` / ``test_loss`` (epoch mean over ranks)."""
        if self.trainer.strategy.runs_own_schedule:
            self.log(name, loss.detach(), sync_dist=name != "train_loss")

    def emit(self, metrics: dict[str, float], callback: bool = False) -> None:
        """A callback's own row straight to the loggers (as Lightning's LearningRateMonitor writes
        ``logger.log_metrics(..., step)``), at the logging step; not in ``logged_metrics``;
        ``callback``: also into ``callback_metrics`` (as the LearningRateMonitor's values are)."""
        t = self.trainer
        if callback:
            self.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if t.is_global_zero and metrics and not t.sanity_checking:
            for lg in t.loggers:
                lg.log_metrics(metrics=metrics, step=self.logging_step)


class TrainerLogging:
    """The Trainer's logging surface (its ``_logging`` connector is made in ``Trainer.__init__``):
    Lightning's metric dicts and ``logger``, and the connector itself (``metrics_connector``: what
    ``TrainModule.log``, the pipeline's loss and the callbacks' own rows go through)."""

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """Lightning's: what callbacks monitor (tensors; ``trainer/logs/connector.py``)."""
        return self._logging.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """Lightning's: the values sent (or due) to the loggers, by logged name."""
        return self._logging.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self._logging.progress_bar_metrics

    @property
    def metrics_connector(self) -> MetricsConnector:
        """What the module's ``self.log`` and the callbacks' own rows (``emit``) go through."""
        return self._logging

    @property
    def _logger_connector(self) -> MetricsConnector:
        """Lightning's name for the Trainer's metrics connector (its tests read ``should_update_logs``)."""
        return self._logging

    @property
    def loggers(self) -> list:
        """Lightning's ``trainer.loggers``; settable (None: no loggers)."""
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: Any) -> None:
        self._loggers = [] if loggers is None else list(loggers)


def _reduce_in_group(value: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``sync_dist_group``: the reduction over that process group only."""
    import torch.distributed as dist

    t = value.clone()
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=ops[op], group=group)
    return t / dist.get_world_size(group) if op == "mean" else t


#: the Trainer whose hook or step is running in this thread (``hook_scope``): a callback's ``self.log``
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("zerotrain_running_trainer", default=None)


def running_module(caller: str) -> Any:
    """The module of the Trainer whose hook is running (Lightning attaches its ``log`` to every
    callback at each stage); a clear error outside any hook."""
    module = getattr(_RUNNING.get(), "module", None)
    if module is None:
        raise ConfigError(f"{caller}: called outside the Trainer's control flow (no hook is running); valid: "
                          "call self.log in a callback's hook")
    return module


@contextlib.contextmanager
def hook_scope(trainer: Any, fx: str) -> Iterator[None]:
    """While hook or step ``fx`` runs, ``self.log`` logs under its name (also the module's
    ``_current_fx_name``, as Lightning's); the previous one is restored after, so nested calls unwind."""
    conn = getattr(trainer, "metrics_connector", None)
    if not isinstance(conn, MetricsConnector):
        yield
        return
    module = getattr(trainer, "module", None)
    previous, conn.fx = conn.fx, fx
    if module is not None:  # Lightning's module attribute, None again when the outermost hook returns
        module._current_fx_name = fx
    token = _RUNNING.set(trainer)
    try:
        yield
    finally:
        _RUNNING.reset(token)
        conn.fx = previous
        if module is not None:
            module._current_fx_name = previous
