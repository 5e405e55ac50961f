"""Progress bars on global rank 0, with Lightning's interface: ``ProgressBar`` (the base a bar of
your own subclasses: totals, descriptions, ``get_metrics``, ``disable``/``enable``, ``print``) and
``TQDMProgressBar(refresh_rate, process_position, leave)``: one tqdm bar per training epoch
("Epoch N", batches of the epoch) and one per evaluation run and loader. zerotrain adds ``tok/s``
to the training bar when the module reports ``tokens_per_sample()``."""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from ..base import Callback

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency
    _tqdm = object  # type: ignore[assignment,misc]

_STAGES = ("train", "val", "test", "predict")


def _finite(total: Any) -> Any:
    """A total tqdm can show: None for an unknown or infinite one."""
    if total is None or (isinstance(total, float) and (math.isinf(total) or math.isnan(total))):
        return None
    return total


class ProgressBar(Callback):
    """The base of every progress bar (Lightning's ``ProgressBar``): what a bar shows, not how."""

    def __init__(self) -> None:
        self._trainer: Any = None
        self._current_eval_dataloader_idx: int | None = None

    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            raise TypeError(f"The `{type(self).__name__}._trainer` reference has not been set yet.")
        return self._trainer

    sanity_check_description = property(lambda self: "Sanity Checking")
    train_description = property(lambda self: "Training")
    validation_description = property(lambda self: "Validation")
    test_description = property(lambda self: "Testing")
    predict_description = property(lambda self: "Predicting")

    @property
    def total_train_batches(self) -> int | float:
        """This epoch's training batches (``inf`` when the loader has no length); with
        ``max_epochs=-1`` and ``max_steps``, no more than the steps left."""
        trainer = self.trainer
        batches = getattr(trainer, "num_training_batches", math.inf)
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            return min(batches, trainer.max_steps - trainer.global_step)
        return batches

    def _current(self, attribute: str) -> int | float:
        batches = getattr(self.trainer, attribute, math.inf)
        if isinstance(batches, (list, tuple)):
            idx = self._current_eval_dataloader_idx or 0
            return batches[idx] if idx < len(batches) else math.inf
        return batches

    @property
    def total_val_batches_current_dataloader(self) -> int | float:
        sanity = getattr(self.trainer, "sanity_checking", False)
        return self._current("num_sanity_val_batches" if sanity else "num_val_batches")

    @property
    def total_test_batches_current_dataloader(self) -> int | float:
        return self._current("num_test_batches")

    @property
    def total_predict_batches_current_dataloader(self) -> int | float:
        return self._current("num_predict_batches")

    @property
    def total_val_batches(self) -> int | float:
        """The validation batches of this epoch, over its loaders: 0 in an epoch that does not
        validate (``check_val_every_n_epoch``), as Lightning's."""
        fit_loop = getattr(self.trainer, "fit_loop", None)
        if fit_loop is not None and not fit_loop.epoch_loop._should_check_val_epoch():
            return 0
        batches = getattr(self.trainer, "num_val_batches", 0)
        return sum(batches) if isinstance(batches, (list, tuple)) else batches

    def has_dataloader_changed(self, dataloader_idx: int) -> bool:
        changed = self._current_eval_dataloader_idx != dataloader_idx
        self._current_eval_dataloader_idx = dataloader_idx
        return changed

    def reset_dataloader_idx_tracker(self) -> None:
        self._current_eval_dataloader_idx = None

    def disable(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement disable()")

    def enable(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement enable()")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print without tearing the bar (the base class simply prints)."""
        print(*args, **kwargs)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()

    def get_metrics(self, trainer: Any, module: Any) -> dict[str, Any]:
        """What the bar's postfix shows: ``v_num`` (the loggers' version) and the metrics logged
        with ``prog_bar=True``; override to change it."""
        standard = standard_metrics(trainer)
        shown = trainer.progress_bar_metrics
        clash = sorted(standard.keys() & shown.keys())
        if clash:
            import warnings

            warnings.warn(f"The progress bar already tracks a metric with the name(s) '{', '.join(clash)}' and "
                          f"`self.log('{clash[0]}', ..., prog_bar=True)` will overwrite this value. If this is "
                          "undesired, change the name or override `get_metrics()` in the progress bar callback.",
                          stacklevel=2)
        return {**standard, **shown}


def standard_metrics(trainer: Any) -> dict[str, Any]:
    """``v_num``: the logger's version (several loggers: their distinct versions as text joined by
    ``_``), the last 4 characters of a string one; nothing without loggers or with an empty version."""
    loggers = list(getattr(trainer, "loggers", []))
    if not loggers:
        return {}
    version = loggers[0].version if len(loggers) == 1 else "_".join(dict.fromkeys(str(lg.version) for lg in loggers))
    if version in ("", None):
        return {}
    return {"v_num": version[-4:] if isinstance(version, str) else version}


class Tqdm(_tqdm):  # type: ignore[misc,valid-type]
    """tqdm whose numbers keep a steady width in the postfix (floats and strings padded to 5
    characters), so the bar does not flicker."""

    @staticmethod
    def format_num(n: Any) -> str:
        pad = isinstance(n, (float, str))
        text = n if isinstance(n, str) else _tqdm.format_num(n)
        if not pad or "e" in text:
            return text
        if "." not in text and len(text) < 5:
            try:
                float(text)
            except ValueError:
                return text
            text += "."
        return text.ljust(5, "0")


class SwitchedBar(ProgressBar):
    """A bar drawn every ``refresh_rate`` (0: never) unless ``disable()``d (the Trainer disables
    it off global rank 0); what the tqdm and Rich bars share."""

    _enabled = True
    _refresh_rate = 1
    refresh_rate = property(lambda self: self._refresh_rate)

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True


class TQDMProgressBar(SwitchedBar):
    """Lightning's default bar: ``refresh_rate`` batches between redraws (0 disables the bar; the
    ``TQDM_MINITERS`` environment variable raises it), ``process_position`` to stack several
    bars, ``leave=True`` keeps each epoch's bar on screen."""

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        super().__init__()
        if os.environ.get("COLAB_GPU") and refresh_rate == 1:
            refresh_rate = 20  # redrawing every batch crashes Colab's output
        elif "TQDM_MINITERS" in os.environ:
            refresh_rate = max(int(os.environ["TQDM_MINITERS"]), refresh_rate)
        self._refresh_rate = refresh_rate
        self._process_position = process_position
        self._leave = leave
        self._enabled = True
        self._bars: dict[str, Any] = dict.fromkeys(_STAGES)
        self._t0, self._step0 = 0.0, 0

    def __getstate__(self) -> dict:
        state = dict(vars(self))
        state["_bars"] = dict.fromkeys(_STAGES)  # tqdm objects do not pickle
        return state

    def _bar(self, stage: str) -> Any:
        if self._bars[stage] is None:
            raise TypeError(f"The `{type(self).__name__}._{stage}_progress_bar` reference has not been set yet.")
        return self._bars[stage]

    def _set(stage: str) -> Any:  # noqa: N805 - builds the four bar properties below
        return property(lambda self: self._bar(stage), lambda self, bar: self._bars.__setitem__(stage, bar))

    train_progress_bar, val_progress_bar = _set("train"), _set("val")
    test_progress_bar, predict_progress_bar = _set("test"), _set("predict")
    del _set

    process_position = property(lambda self: self._process_position)

    # ---- the bars, as Lightning makes them (override to change one)
    def _tqdm(self, desc: str, position: int, leave: bool, **kwargs: Any) -> Tqdm:
        return Tqdm(desc=desc, position=position, disable=self.is_disabled, leave=leave, dynamic_ncols=True,
                    file=sys.stdout, bar_format=self.BAR_FORMAT, **kwargs)

    def init_sanity_tqdm(self) -> Tqdm:
        return self._tqdm(self.sanity_check_description, 2 * self.process_position, False)

    def init_train_tqdm(self) -> Tqdm:
        return self._tqdm(self.train_description, 2 * self.process_position, True, smoothing=0)

    def init_predict_tqdm(self) -> Tqdm:
        return self._tqdm(self.predict_description, 2 * self.process_position, True, smoothing=0)

    def init_validation_tqdm(self) -> Tqdm:
        in_fit = _fn(self.trainer, self._bars["train"] is not None) != "validate"  # under the training bar
        return self._tqdm(self.validation_description, 2 * self.process_position + in_fit, not in_fit)

    def init_test_tqdm(self) -> Tqdm:
        return self._tqdm("Testing", 2 * self.process_position, True)

    # ---- training
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        _restart(self.train_progress_bar, _finite(self.total_train_batches), f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self._bars["train"]
        if bar is not None and self._should_update(batch_idx + 1, bar.total):
            _move(bar, batch_idx + 1)
            bar.set_postfix({**self.get_metrics(trainer, pl_module), **self._throughput(trainer, pl_module)})

    def _throughput(self, trainer: Any, module: Any) -> dict[str, str]:
        """zerotrain's ``tok/s`` (all ranks), when the module says how many tokens a sample has."""
        tps = module.tokens_per_sample() if hasattr(module, "tokens_per_sample") else None
        elapsed = time.perf_counter() - self._t0
        batch_size = getattr(trainer.train_dataloader, "batch_size", None)
        if not tps or elapsed <= 0 or not batch_size:
            return {}
        tokens = (trainer.global_step - self._step0) * trainer.accumulate_grad_batches * batch_size * tps
        return {"tok/s": f"{tokens * trainer.strategy.data_parallel_world_size / elapsed:.0f}"}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        bar = self._bars["train"]
        if bar is not None and not bar.disable:
            bar.set_postfix(self.get_metrics(trainer, pl_module))
        if bar is not None and self._leave:
            bar.close()

    def on_train_end(self, *_: Any) -> None:
        if self._bars["train"] is not None:
            self._bars["train"].close()

    # ---- evaluation (validation, its sanity check, test and predict)
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if getattr(trainer, "sanity_checking", False):
            self.val_progress_bar = self.init_sanity_tqdm()
        else:
            self.val_progress_bar = self.init_validation_tqdm()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self.test_progress_bar = self.init_test_tqdm()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self.predict_progress_bar = self.init_predict_tqdm()

    def _eval_batch_start(self, stage: str, dataloader_idx: int) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        if stage == "val":
            sanity = getattr(self.trainer, "sanity_checking", False)
            total = self.total_val_batches_current_dataloader
            desc = self.sanity_check_description if sanity else self.validation_description
        elif stage == "test":
            total, desc = self.total_test_batches_current_dataloader, self.test_description
        else:
            total, desc = self.total_predict_batches_current_dataloader, self.predict_description
        _restart(self._bar(stage), _finite(total), f"{desc} DataLoader {dataloader_idx}")

    def _eval_batch_end(self, stage: str, batch_idx: int) -> None:
        bar = self._bars[stage]
        if bar is not None and self._should_update(batch_idx + 1, bar.total):
            _move(bar, batch_idx + 1)

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self._eval_batch_start("val", dataloader_idx)

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        self._eval_batch_start("test", dataloader_idx)

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        self._eval_batch_start("predict", dataloader_idx)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._eval_batch_end("val", batch_idx)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._eval_batch_end("test", batch_idx)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._eval_batch_end("predict", batch_idx)

    def _eval_end(self, stage: str) -> None:
        if self._bars[stage] is not None:
            self._bars[stage].close()
        self.reset_dataloader_idx_tracker()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """In fit, the training bar shows the validation's values; after the sanity check too, as
        Lightning's (whose training bar is then a hidden stand-in: ``get_metrics`` is called)."""
        self._eval_end("val")
        if _fn(trainer, True) == "fit":
            metrics = self.get_metrics(trainer, pl_module)
            if self._bars["train"] is not None and not getattr(trainer, "sanity_checking", False):
                self._bars["train"].set_postfix(metrics)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval_end("test")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval_end("predict")

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        for bar in self._bars.values():
            if bar is not None:
                bar.close()

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print above the first bar still drawn (``tqdm.write``), so it is not torn."""
        bar = next((b for b in self._bars.values() if b is not None and not b.disable), None)
        if bar is None:
            print(*args, sep=sep, **kwargs)
        else:
            bar.write(sep.join(map(str, args)), **kwargs)

    def _should_update(self, current: int, total: Any) -> bool:
        return self.is_enabled and (current % self.refresh_rate == 0 or current == total)


def _fn(trainer: Any, fitting: bool) -> str | None:
    """The running entry point (``"fit" | "validate" | "test" | "predict"``): Lightning's
    ``trainer.state.fn`` where the Trainer has one, else ``fit`` when ``fitting``."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    if fn is not None:
        return getattr(fn, "value", fn)
    return "fit" if fitting else "validate"


def _restart(bar: Any, total: Any, description: str) -> None:
    bar.reset()
    bar.total = total
    bar.initial = 0
    bar.set_description(description)


def _move(bar: Any, n: int) -> None:
    if not bar.disable:
        bar.n = n
        bar.refresh()


def __getattr__(name: str) -> Any:
    """``zerotrain.callbacks.progress`` is also Lightning's ``callbacks.progress`` package, which
    exports the Rich bar too (imported when asked: ``rich_progress`` imports this module)."""
    if name in ("RichProgressBar", "RichProgressBarTheme"):
        from . import rich_progress

        return getattr(rich_progress, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
