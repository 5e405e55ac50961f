"""What one ``self.log`` call means, as pytorch-lightning 2.x defines it: which hooks may log and
their on_step/on_epoch defaults, the accepted ``reduce_fx``, the batch size a value is weighted
by, and how the values of one name combine (``_Result``: per-step value and batch-size-weighted
epoch mean, or sum/max/min) within a loop (``ResultCollection``). ``trainer/logs/connector.py`` is the
Trainer's side: which collection is active, the metric dicts and the rows sent to the loggers.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any, Callable, Iterator

import torch

from ..errors import ConfigError

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
        raise ValueError(f"`self.log({name}, {value})` was called, but nested dictionaries cannot be logged; "
                         "valid: self.log_dict for a flat dict")
    if hasattr(value, "compute") and hasattr(value, "update") and not torch.is_tensor(value):
        raise ValueError(f"self.log({name!r}, <{type(value).__name__}>): torchmetrics Metric objects are not "
                         f"supported by zerotrain (a deliberate difference); valid: log metric.compute() or the "
                         "value of metric(preds, target)")
    if torch.is_tensor(value):
        t = value.clone().detach()
    elif isinstance(value, numbers.Number):
        t = torch.tensor(value, device=device, dtype=_default_dtype())
    else:
        raise ValueError(f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot be "
                         "logged; valid: a number or a one-element tensor")
    if t.numel() != 1:
        raise ValueError(f"self.log({name!r}, <tensor of shape {tuple(t.shape)}>): the tensor must have a single "
                         f"element; valid: self.log({name!r}, value.mean()) or another reduction")
    return t.squeeze()  # a 0-dim value, as Lightning's, whatever shape the one element came in


def batch_size_of(batch: Any) -> int:
    """Lightning's batch size inference: the first dimension of the first tensor found in the
    batch (a 0-dim tensor counts 1); a warning when the batch holds tensors of different sizes."""
    found = None
    for size in _sizes(batch):
        if found is None:
            found = size
        elif size != found:
            warn_once(f"Trying to infer the batch_size from an ambiguous collection. The batch size we found is "
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


def warn_once(message: str) -> None:
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
            raise ConfigError(f"`self.log({self.name}, on_step=False, on_epoch=False)` is not useful: it logs "
                              "nothing; valid: at least one of them True")

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
            warn_once(f"You called self.log({self.meta.name!r}, ...) in {self.meta.fx} but the value needs to be "
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
            raise ConfigError(f"You called `self.log({meta.name}, ...)` twice in `{meta.fx}` with different arguments. "
                              "This is not allowed")
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
                warn_once(f"It is recommended to use self.log({meta.name!r}, ..., sync_dist=True) when logging on "
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
