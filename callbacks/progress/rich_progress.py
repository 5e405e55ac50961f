"""Lightning's Rich callbacks: ``RichProgressBar`` (the bars drawn by ``rich.progress``) and
``RichModelSummary`` (the model summary as a Rich table). ``rich`` is an optional dependency
(``pip install zerotrain[rich]``); without it both raise a ``ModuleNotFoundError`` saying so."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...trainer.compat.imports import version_at_least
from . import SwitchedBar, _finite, _fn
from ..summary import ModelSummary, _bytes, _count

log = logging.getLogger("zerotrain")


def _need_rich(what: str) -> None:
    if not version_at_least("rich", "10.2.2"):
        raise ModuleNotFoundError(f"`{what}` requires `rich` >= 10.2.2. Install it by running `pip install -U rich`.")


@dataclass
class RichProgressBarTheme:
    """Rich styles of the bar's parts (Lightning's names and defaults)."""

    description: Any = ""
    progress_bar: Any = "#6206E0"
    progress_bar_finished: Any = "#6206E0"
    progress_bar_pulse: Any = "#6206E0"
    batch_progress: Any = ""
    time: Any = "dim"
    processing_speed: Any = "dim underline"
    metrics: Any = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class RichProgressBar(SwitchedBar):
    """``RichProgressBar(refresh_rate=100, leave=False, theme=RichProgressBarTheme(),
    console_kwargs=None)``: one Rich task per training epoch and per evaluation loader, with the
    batches done, time, speed and the ``get_metrics`` values; ``refresh_rate`` redraws per second
    (0 disables the bar)."""

    def __init__(self, refresh_rate: int = 100, leave: bool = False, theme: RichProgressBarTheme | None = None,
                 console_kwargs: dict[str, Any] | None = None) -> None:
        _need_rich("RichProgressBar")
        super().__init__()
        self._refresh_rate, self._leave = refresh_rate, leave
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self._console_kwargs = console_kwargs or {}
        self._enabled = True
        self.progress: Any = None
        self.train_progress_bar_id: Any = None
        self.val_sanity_progress_bar_id: Any = None
        self.val_progress_bar_id: Any = None
        self.test_progress_bar_id: Any = None
        self.predict_progress_bar_id: Any = None

    def _task(self, attribute: str) -> Any:
        task_id = getattr(self, attribute)
        assert self.progress is not None and task_id is not None, f"no {attribute} task yet"
        return self.progress.tasks[task_id]

    train_progress_bar = property(lambda self: self._task("train_progress_bar_id"))
    val_sanity_check_bar = property(lambda self: self._task("val_sanity_progress_bar_id"))
    val_progress_bar = property(lambda self: self._task("val_progress_bar_id"))
    test_progress_bar = property(lambda self: self._task("test_progress_bar_id"))

    def _start(self) -> None:
        if self.is_disabled or self.progress is not None:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        theme = self.theme
        self.progress = Progress(
            TextColumn("[progress.description]{task.description}", style=theme.description),
            BarColumn(complete_style=theme.progress_bar, finished_style=theme.progress_bar_finished,
                      pulse_style=theme.progress_bar_pulse),
            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}", style=theme.metrics),
            console=Console(**self._console_kwargs), refresh_per_second=max(self._refresh_rate, 1),
            transient=not self._leave, auto_refresh=True)
        self.progress.start()

    def _metrics_text(self, trainer: Any, module: Any) -> str:
        shown = []
        for name, value in self.get_metrics(trainer, module).items():
            value = float(value) if hasattr(value, "item") else value
            shown.append(f"{name}: {format(value, self.theme.metrics_format) if isinstance(value, float) else value}")
        return self.theme.metrics_text_delimiter.join(shown)

    def _add(self, total: Any, description: str) -> Any:
        return self.progress.add_task(description, total=_finite(total), metrics="")

    # ---- training
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.progress is None:
            return
        description = f"Epoch {trainer.current_epoch}"
        if trainer.max_epochs is not None:
            description += f"/{trainer.max_epochs - 1}"
        description = description.ljust(len(self.validation_description))
        if self.train_progress_bar_id is not None and self._leave:
            self.train_progress_bar_id = None
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self._add(self.total_train_batches, description)
        else:
            self.progress.reset(self.train_progress_bar_id, total=_finite(self.total_train_batches),
                                description=description, visible=True)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, completed=batch_idx + 1,
                                 metrics=self._metrics_text(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, metrics=self._metrics_text(trainer, pl_module))

    # ---- evaluation
    def _eval_start(self, attribute: str) -> None:
        self._start()
        setattr(self, attribute, None)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start("val_sanity_progress_bar_id" if trainer.sanity_checking else "val_progress_bar_id")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start("test_progress_bar_id")

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._eval_start("predict_progress_bar_id")

    def _eval_batch_start(self, attribute: str, total: Any, description: str, dataloader_idx: int) -> None:
        if self.progress is None or not self.has_dataloader_changed(dataloader_idx):
            return
        task_id = getattr(self, attribute)
        if task_id is not None:
            self.progress.update(task_id, visible=False)
        setattr(self, attribute, self._add(total, f"{description} DataLoader {dataloader_idx}"))

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        sanity = trainer.sanity_checking
        self._eval_batch_start("val_sanity_progress_bar_id" if sanity else "val_progress_bar_id",
                               self.total_val_batches_current_dataloader,
                               self.sanity_check_description if sanity else self.validation_description, dataloader_idx)

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch_start("test_progress_bar_id", self.total_test_batches_current_dataloader,
                               self.test_description, dataloader_idx)

    def on_predict_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:
        self._eval_batch_start("predict_progress_bar_id", self.total_predict_batches_current_dataloader,
                               self.predict_description, dataloader_idx)

    def _advance(self, attribute: str, batch_idx: int) -> None:
        task_id = getattr(self, attribute)
        if self.progress is not None and task_id is not None:
            self.progress.update(task_id, completed=batch_idx + 1)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._advance("val_sanity_progress_bar_id" if trainer.sanity_checking else "val_progress_bar_id", batch_idx)

    def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:
        self._advance("test_progress_bar_id", batch_idx)

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None:
        self._advance("predict_progress_bar_id", batch_idx)

    def _eval_end(self, attribute: str) -> None:
        task_id = getattr(self, attribute)
        if self.progress is not None and task_id is not None:
            self.progress.update(task_id, visible=False)
        self.reset_dataloader_idx_tracker()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval_end("val_sanity_progress_bar_id" if trainer.sanity_checking else "val_progress_bar_id")
        if _fn(trainer, self.train_progress_bar_id is not None) == "fit" and self.train_progress_bar_id is not None \
                and self.progress is not None:
            self.progress.update(self.train_progress_bar_id, metrics=self._metrics_text(trainer, pl_module))

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval_end("test_progress_bar_id")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._eval_end("predict_progress_bar_id")

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.progress = None
        self.train_progress_bar_id = self.val_progress_bar_id = self.val_sanity_progress_bar_id = None
        self.test_progress_bar_id = self.predict_progress_bar_id = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.progress is not None:
            self.progress.console.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {**vars(self), "progress": None}


class RichModelSummary(ModelSummary):
    """``RichModelSummary(max_depth=1, header_style="bold magenta", **summarize_kwargs)``: the
    ``ModelSummary`` numbers (zerotrain's per-rank bytes included) printed as a Rich table."""

    def __init__(self, max_depth: int = 1, header_style: str = "bold magenta", **summarize_kwargs: Any) -> None:
        _need_rich("RichModelSummary")
        super().__init__(max_depth=max_depth)
        self.header_style = header_style
        self._summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from ..summary import max_bytes_per_rank, module_rows, parameter_totals

        self.rows = module_rows(pl_module, self.max_depth)
        self.totals = parameter_totals(pl_module)
        self.bytes_per_rank = max_bytes_per_rank(trainer.strategy)
        if trainer.is_global_zero:
            self.render()

    def render(self) -> None:
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=self.header_style)
        for column, justify in ((" ", "right"), ("Name", "left"), ("Type", "left"), ("Params", "right")):
            table.add_column(column, justify=justify, no_wrap=True)
        for i, (name, kind, params) in enumerate(self.rows):
            table.add_row(str(i), name, kind, _count(params))
        console = get_console()
        console.print(table)
        t = self.totals
        lines = [f"[bold]Trainable params[/]: {_count(t['trainable'])}",
                 f"[bold]Non-trainable params[/]: {_count(t['frozen'])}",
                 f"[bold]Total params[/]: {_count(t['total'])}"]
        lines += [f"[bold]{k} per rank (largest rank)[/]: {_bytes(v)}" for k, v in self.bytes_per_rank.items() if v]
        console.print("\n".join(lines))
