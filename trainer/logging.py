"""``self.log`` with pytorch-lightning 2.x's semantics: which hooks may log and their defaults, the
per-step and per-epoch values (epoch means weighted by batch size), the ``_step``/``_epoch``
names, ``sync_dist`` over ranks, ``trainer.callback_metrics`` / ``logged_metrics`` /
``progress_bar_metrics``, and what the loggers receive at which step.

Three pieces: ``_Result`` (one logged name: its running value), ``ResultCollection`` (every name
logged in one loop: training, or evaluation) and ``MetricsConnector`` (the Trainer's side: which
collection is active, the three metric dicts, and when rows go to the loggers). The Trainer calls
the connector at Lightning's points of the loop; nothing here knows the strategy but its
``reduce``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
from typing import Any, Callable, Iterator

import torch

from .errors import ConfigError

log = logging.getLogger("zerotrain")

# ---------------------------------------------------------------------------- where logging is allowed
#: (default on_step, default on_epoch, allowed on_step values, allowed on_epoch values) per hook
_PER_STEP = (True, False, (False, True), (False, True))
_PER_EVAL_STEP = (False, True, (False, True), (False, True))
_EPOCH_ONLY = (False, True, (False,), (True,))
HOOK_LEVELS: dict[str, tuple | None] = {
    **dict.fromkeys(("training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward",
                     "backward", "on_after_backward", "on_before_optimizer_step", "optimizer_step",
                     "configure_gradient_clipping", "clip_gradients", "on_before_zero_grad",
                     "optimizer_zero_grad"), _PER_STEP),
    **dict.fromkeys(("validation_step", "test_step", "on_validation_batch_start", "on_validation_batch_end",
                     "on_test_batch_start", "on_test_batch_end"), _PER_EVAL_STEP),
    **dict.fromkeys(("on_train_start", "on_validation_start", "on_test_start", "on_train_epoch_start",
                     "on_train_epoch_end", "on_validation_epoch_start", "on_validation_epoch_end",
                     "on_test_epoch_start", "on_test_epoch_end"), _EPOCH_ONLY),
    # Lightning refuses self.log in these (log to self.logger.experiment instead)
    **dict.fromkeys(("on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end", "on_train_end",
                     "on_validation_end", "on_test_end", "on_predict_start", "on_predict_end",
                     "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start",
                     "on_predict_batch_end", "predict_step", "lr_scheduler_step", "on_exception", "state_dict",
                     "load_state_dict", "on_save_checkpoint", "on_load_checkpoint", "setup", "teardown",
                     "configure_model", "configure_optimizers", "configure_callbacks", "prepare_data",
                     "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
                     "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
                     "on_validation_model_zero_grad", "on_validation_model_eval", "on_test_model_eval",
                     "on_validation_model_train", "on_test_model_train"), None),
}

#: ``reduce_fx`` accepted: Lightning's strings ("avg" is "mean") and the torch / builtin functions
REDUCTIONS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_REDUCE_FUNCTIONS = {torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max", max: "max",
                     torch.min: "min", min: "min"}

DATALOADER_SUFFIX = "/dataloader_idx_{}"


def log_levels(fx: str | None, on_step: bool | None, on_epoch: bool | None) -> tuple[bool, bool]:
    """Lightning's per-hook defaults and limits: ``on_step``/``on_epoch`` for a ``self.log`` in
    ``fx``, or a clear error where that hook may not log (or not at that level)."""
    if fx is None:
        raise ConfigError("self.log: called outside the Trainer's control flow (no hook or step is running); "
                          "valid: log from a *_step method or a hook")
    if fx not in HOOK_LEVELS:
        raise ConfigError(f"self.log: fx={fx!r}: logging inside this hook is not supported; valid: the step methods "
                          "and the hooks Lightning allows")
    levels = HOOK_LEVELS[fx]
    if levels is None:
        raise ConfigError(f"self.log: fx={fx!r}: you can't self.log() inside {fx} (as Lightning); log directly to "
                          "the logger with self.logger.log_metrics(...) instead")
    step = levels[0] if on_step is None else bool(on_step)
    epoch = levels[1] if on_epoch is None else bool(on_epoch)
    for what, value, allowed in (("on_step", step, levels[2]), ("on_epoch", epoch, levels[3])):
        if value not in allowed:
            raise ConfigError(f"self.log: {what}={value} inside {fx}; valid: {what} in {allowed}")
    return step, epoch


def reduce_name(reduce_fx: Any) -> str:
    """``reduce_fx`` as one of mean / sum / max / min, or Lightning's error."""
    name = REDUCTIONS.get(reduce_fx.lower()) if isinstance(reduce_fx, str) else _REDUCE_FUNCTIONS.get(reduce_fx)
    if name is None:
        raise ConfigError(f"self.log: reduce_fx={reduce_fx!r}; valid: 'mean' ('avg'), 'sum', 'max', 'min' or "
                          "torch.mean / torch.sum / torch.max / torch.min (log a torchmetrics Metric for others)")
    return name


def _default_dtype() -> torch.dtype:
    """Logged values are kept in the default float dtype, but no lower than float32."""
    dtype = torch.get_default_dtype()
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def as_value(name: str, value: Any, device: torch.device | None = None) -> torch.Tensor:
    """A loggable value as Lightning takes it: a number or a one-element tensor, detached later.
    Dicts, strings, several elements and other objects are refused as Lightning refuses them."""
    if isinstance(value, dict):
        raise ValueError(f"self.log({name!r}, {value!r}): nested dictionaries cannot be logged; valid: "
                         "self.log_dict for a flat dict")
    if hasattr(value, "compute") and hasattr(value, "update") and not torch.is_tensor(value):
        raise ValueError(f"self.log({name!r}, <{type(value).__name__}>): torchmetrics Metric objects are not "
                         f"supported by zerotrain (a deliberate difference); valid: log metric.compute() or the "
                         "value of metric(preds, target)")
    if torch.is_tensor(value):
        t = value.clone().detach()
    elif isinstance(value, numbers.Number):
        t = torch.tensor(value, device=device, dtype=_default_dtype())
    else:
        raise ValueError(f"self.log({name!r}, {value!r}): {type(value).__name__} values cannot be logged; valid: "
                         "a number or a one-element tensor")
    if t.numel() != 1:
        raise ValueError(f"self.log({name!r}, <tensor of shape {tuple(t.shape)}>): the tensor must have a single "
                         f"element; valid: self.log({name!r}, value.mean()) or another reduction")
    return t


def batch_size_of(batch: Any) -> int:
    """Lightning's batch size inference: the first dimension of the first tensor found in the
    batch (a 0-dim tensor counts 1); a warning when the batch holds tensors of different sizes."""
    found = None
    for size in _sizes(batch):
        if found is None:
            found = size
        elif size != found:
            _warn_once(f"Trying to infer the batch_size from an ambiguous collection. The batch size we found is "
                       f"{found}. To avoid any miscalculations, use self.log(..., batch_size=batch_size).")
            break
    if found is None:
        raise ConfigError("self.log: could not infer the batch_size from the batch; valid: simplify its structure "
                          "or pass self.log(..., batch_size=n)")
    return found


def _sizes(batch: Any) -> Iterator[int | None]:
    if torch.is_tensor(batch):
        yield 1 if batch.ndim == 0 else batch.size(0)
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _sizes(v)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            yield from _sizes(getattr(batch, f.name))
    elif isinstance(batch, (list, tuple)) or (hasattr(batch, "__iter__") and not isinstance(batch, (str, bytes))):
        for v in batch:
            yield from _sizes(v)
    else:
        yield None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Lightning's WarningCache: each message once per process, on global rank 0's log."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


# ---------------------------------------------------------------------------- one logged name
@dataclasses.dataclass
class Meta:
    """How a name was logged. Logging it again in the same hook with other options is an error."""
    fx: str
    name: str
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce: str
    enable_graph: bool
    add_dataloader_idx: bool
    dataloader_idx: int | None
    sync: bool
    sync_group: Any
    rank_zero_only: bool

    def __post_init__(self) -> None:
        if not self.on_step and not self.on_epoch:
            raise ConfigError(f"self.log({self.name!r}, on_step=False, on_epoch=False): logs nothing; valid: "
                              "at least one of them True")

    def names(self, on_step: bool) -> tuple[str, str]:
        """(the plain name, the name at this level: ``_step``/``_epoch`` added when logged at
        both), each with ``/dataloader_idx_<i>`` when evaluating one of several loaders."""
        forked = f"{self.name}_{'step' if on_step else 'epoch'}" if self.on_step and self.on_epoch else self.name
        if self.add_dataloader_idx and self.dataloader_idx is not None:
            suffix = DATALOADER_SUFFIX.format(self.dataloader_idx)
            return self.name + suffix, forked + suffix
        return self.name, forked


class _Result:
    """One name's running value: its last step value, and its epoch accumulation (a batch-size
    weighted sum for mean, else the running sum / max / min), in float32 or float64."""

    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.reset()

    def reset(self) -> None:
        default = {"max": float("-inf"), "min": float("inf")}.get(self.meta.reduce, 0.0)
        self.value = torch.tensor(default, dtype=_default_dtype())
        self.weight = torch.tensor(0)  # the summed batch sizes of a mean
        self.step_value: torch.Tensor | None = None
        self.computed: torch.Tensor | None = None
        self.has_reset = True

    def update(self, value: torch.Tensor, batch_size: int, sync: Callable) -> None:
        if not torch.is_floating_point(value):
            _warn_once(f"You called self.log({self.meta.name!r}, ...) in {self.meta.fx} but the value needs to be "
                       f"floating to be reduced. Converting it to {_default_dtype()}.")
        if value.dtype not in (torch.float32, torch.float64):
            value = value.to(_default_dtype())
        self.has_reset, self.computed = False, None
        if self.value.device != value.device:
            self.value, self.weight = self.value.to(value.device), self.weight.to(value.device)
        if self.meta.on_step:
            self.step_value = sync(value.clone(), self.meta)
            if not self.meta.on_epoch:
                self.value = self.step_value
                return
        if self.meta.reduce == "mean":
            self.value = self.value + value * batch_size
            self.weight = self.weight + batch_size
        elif self.meta.reduce == "sum":
            self.value = self.value + value
        else:
            self.value = getattr(torch, self.meta.reduce)(self.value, value)

    def compute(self, sync: Callable) -> torch.Tensor:
        if self.computed is None:
            value = sync(self.value.clone(), self.meta)
            self.computed = value / sync(self.weight, self.meta) if self.meta.reduce == "mean" else value
        return self.computed


class ResultCollection(dict):
    """Every name logged in one loop (``training``: the fit loop's; else an evaluation's), keyed
    by hook, name and dataloader index as Lightning's."""

    def __init__(self, training: bool, sync: Callable, distributed: Callable[[], bool]) -> None:
        super().__init__()
        self.training, self._sync, self._distributed = training, sync, distributed
        self.batch: Any = None
        self.batch_size: int | None = None
        self.dataloader_idx: int | None = None

    def log(self, meta: Meta, value: torch.Tensor, batch_size: int | None) -> None:
        key = f"{meta.fx}.{meta.name}"
        if meta.add_dataloader_idx and self.dataloader_idx is not None:
            key += f".{self.dataloader_idx}"
            meta.fx += f".{self.dataloader_idx}"
        meta.dataloader_idx = self.dataloader_idx
        if key not in self:
            self[key] = _Result(meta)
        elif meta != self[key].meta:
            raise ConfigError(f"self.log({meta.name!r}, ...) twice in {meta.fx} with different arguments; valid: "
                              "the same arguments every time a name is logged in a hook")
        self[key].update(value, self._batch_size(meta, batch_size), self._sync)

    def _batch_size(self, meta: Meta, given: int | None) -> int:
        """The batch size weighting a mean: given, else inferred once per batch from the batch
        (only for what an epoch mean needs; 1 otherwise), as Lightning."""
        if given is not None:
            return given
        if self.batch_size is not None:
            return self.batch_size
        if self.batch is not None and meta.on_epoch and meta.reduce == "mean":
            self.batch_size = batch_size_of(self.batch)
            return self.batch_size
        return 1

    def metrics(self, on_step: bool) -> dict[str, dict[str, Any]]:
        """Lightning's three views at a step (``on_step``) or at an epoch's end: ``log`` (what the
        loggers get), ``callback`` (``trainer.callback_metrics``: training keeps both levels,
        evaluation only epoch values) and ``pbar`` (numbers, for the progress bar)."""
        out: dict[str, dict[str, Any]] = {"callback": {}, "log": {}, "pbar": {}}
        for result in self.values():
            meta = result.meta
            if result.has_reset or meta.dataloader_idx != self.dataloader_idx:
                continue
            value = self._value(result, on_step)
            if value is None:
                continue
            name, forked = meta.names(on_step)
            if meta.logger:
                out["log"][forked] = value
            if self.training or (meta.on_epoch and not on_step):
                out["callback"][name] = out["callback"][forked] = value
            if meta.prog_bar:
                out["pbar"][forked] = value.item()
        return out

    def _value(self, result: _Result, on_step: bool) -> torch.Tensor | None:
        meta = result.meta
        if on_step:
            value = result.step_value if meta.on_step else None
        elif meta.on_epoch:
            if result.computed is None and not meta.sync and self._distributed():
                _warn_once(f"It is recommended to use self.log({meta.name!r}, ..., sync_dist=True) when logging on "
                           "epoch level in distributed setting to accumulate the metric across devices (zerotrain, "
                           "as Lightning, logs each rank's own value otherwise).")
            value = result.compute(self._sync)
        else:
            value = None
        return value if value is None or meta.enable_graph else value.detach()

    def reset(self, fx: str | None = None) -> None:
        for result in self.values():
            if fx is None or result.meta.fx == fx:
                result.reset()


# ---------------------------------------------------------------------------- the Trainer's side
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

    # ---- self.log
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None, metric_attribute: str | None = None,
            rank_zero_only: bool = False) -> None:
        """``TrainModule.log``: Lightning's checks, defaults and bookkeeping (see the module doc)."""
        value = as_value(name, value, self._device())
        fx = self.fx
        on_step, on_epoch = log_levels(fx, on_step, on_epoch)
        if add_dataloader_idx and "/dataloader_idx_" in name:
            raise ConfigError(f"self.log({name!r}): the name must not hold /dataloader_idx_ while "
                              "add_dataloader_idx=True (it is added for you)")
        results = self.active
        if results is None:
            raise ConfigError(f"self.log({name!r}): no loop is running (predict logs nothing, as Lightning)")
        if self.current_fx != fx and self.first_iter in (None, True):
            results.reset(fx=fx)  # a new epoch of this hook: forget the previous one's values
        if logger and not self.trainer.loggers:
            _warn_once(f"You called self.log({name!r}, ..., logger=True) but have no logger configured.")
        meta = Meta(fx, name, bool(prog_bar), logger is not False, on_step, on_epoch, reduce_name(reduce_fx),
                    bool(enable_graph), bool(add_dataloader_idx), None,
                    bool(sync_dist) and self._distributed(), sync_dist_group, bool(rank_zero_only))
        results.log(meta, value if enable_graph else value.detach(), batch_size)
        self.current_fx = fx

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
        if t.loggers and every and n_batches < every and t.is_global_zero:
            log.warning("The number of training batches (%s) is smaller than the logging interval "
                        "Trainer(log_every_n_steps=%d). Set a lower value for log_every_n_steps if you want to see "
                        "logs for the training epoch.", n_batches, every)

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
            lg.log_metrics(row, step)
            lg.save()


class TrainerLogging:
    """The Trainer's logging surface (its ``_logging`` connector is made in ``Trainer.__init__``):
    Lightning's metric dicts and ``logger``, the entry point of ``TrainModule.log``, and
    zerotrain's own loss logging."""

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """Lightning's: what callbacks monitor (tensors; ``trainer/logging.py``)."""
        return self._logging.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """Lightning's: the values sent (or due) to the loggers, by logged name."""
        return self._logging.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        return self._logging.progress_bar_metrics

    @property
    def logger(self) -> Any:
        """The first logger, or None (Lightning's ``trainer.logger``)."""
        return self.loggers[0] if self.loggers else None

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        """``TrainModule.log``: Lightning's semantics, in the running hook's name."""
        self._train_logged = self._val_logged = True
        self._logging.log(name, value, **kwargs)

    def _log_loss(self, name: str, loss: torch.Tensor) -> None:
        """zerotrain's own: a step that logs nothing has its loss logged as ``train_loss`` /
        ``val_loss`` / ``test_loss`` (Lightning logs nothing then; said once, at the first)."""
        if name not in self._said_loss and self.is_global_zero:
            self._said_loss.add(name)
            log.warning("the step logged nothing: zerotrain logs its returned loss as %r (per step in training, "
                        "the epoch mean over ranks in evaluation); Lightning logs nothing. self.log a metric to "
                        "turn this off", name)
        self._log(name, loss.detach(), sync_dist=name != "train_loss")

    def _emit(self, metrics: dict[str, float], callback: bool = False) -> None:
        """A callback's own row straight to the loggers (as Lightning's LearningRateMonitor writes
        ``logger.log_metrics(..., step)``), at the logging step; not in ``logged_metrics``;
        ``callback``: also into ``callback_metrics`` (as the LearningRateMonitor's values are)."""
        if callback:
            self._logging.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if self.is_global_zero and metrics and not self.sanity_checking:
            for lg in self.loggers:
                lg.log_metrics(metrics, self._logging.logging_step)


def _reduce_in_group(value: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``sync_dist_group``: the reduction over that process group only."""
    import torch.distributed as dist

    t = value.clone()
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(t, op=ops[op], group=group)
    return t / dist.get_world_size(group) if op == "mean" else t


@contextlib.contextmanager
def hook_scope(trainer: Any, fx: str) -> Iterator[None]:
    """While hook or step ``fx`` runs, ``self.log`` logs under its name (Lightning's
    ``_current_fx_name``); the previous one is restored after, so nested calls unwind."""
    conn = getattr(trainer, "_logging", None)
    if not isinstance(conn, MetricsConnector):
        yield
        return
    previous, conn.fx = conn.fx, fx
    try:
        yield
    finally:
        conn.fx = previous
