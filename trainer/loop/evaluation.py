"""The Trainer's evaluation loop: ``validate``, ``test`` and ``predict``, and the validation inside
``fit`` (its sanity check included). Every rank runs every forward together, so a sharded model
(ZeRO-3) gathers collectively; results are returned as Lightning returns them.

``TrainerEvaluation`` is a part of ``Trainer`` (``trainer/loop/trainer.py``), like ``TrainerLogging``:
it reads and sets the Trainer's state (strategy, module, hooks, logging connector, limits,
``sanity_checking``) and holds none of its own.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Iterable, NamedTuple

import torch
from torch.utils.data import DataLoader

from ..checkpoint import protocol as checkpointing
from ..api import hparams
from ..launch import job
from ..api.datamodule import DataModule
from ..compat.lightning.validator import verify_stage
from .compiled import take_compiled
from ..errors import ConfigError
from ..logs.connector import hook_scope
from ..data.batch_transfer import transfer_batch
from .model_mode import ModelMode
from ..api.module import TrainModule
from ..data.predict_indices import batch_indices, with_index_tracking
from .state import RunningStage
from ..utilities import isolate_rng, rank_zero_warn
from .signature import overridden, required_without_default, takes

log = logging.getLogger("zerotrain")


class TrainerEvaluation:
    """Lightning's evaluation stages on the Trainer."""

    def validate(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
                 ckpt_path: str | None = None, verbose: bool = True,
                 datamodule: DataModule | None = None, weights_only: bool | None = None) -> list[dict[str, float]]:
        """Run ``validation_step`` over the validation loader(s) on every rank together; returns one
        dict of epoch-level metrics per loader, as Lightning. ``ckpt_path``, ``weights_only``: as ``test``."""
        return self._run_stage("validate", model, dataloaders, datamodule, ckpt_path, verbose)

    def test(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
             ckpt_path: str | None = None, verbose: bool = True,
             datamodule: DataModule | None = None, weights_only: bool | None = None) -> list[dict[str, float]]:
        """Run ``test_step`` over the test loader(s) on every rank together (a sharded model's
        forward gathers collectively); returns one dict of epoch-level metrics per loader, as
        Lightning. ``ckpt_path``: a checkpoint directory, ``"best"``, ``"last"``/``"latest"`` -
        only the model's weights are loaded; None with no ``model`` means ``"best"``, as Lightning.
        ``weights_only``: Lightning's argument, accepted (a checkpoint is always read weights-only)."""
        return self._run_stage("test", model, dataloaders, datamodule, ckpt_path, verbose)

    def predict(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | None = None, weights_only: bool | None = None) -> list[Any] | None:
        """Run ``predict_step`` over the predict loader(s) on every rank together; returns this
        rank's ``predict_step`` outputs in order (a list per loader when there are several), as
        Lightning - or None with ``return_predictions=False``. ``weights_only``: as ``test``."""
        out = self._run_stage("predict", model, dataloaders, datamodule, ckpt_path, False)
        return out if return_predictions is not False else None

    # ------------------------------------------------------------------ stages
    def _run_stage(self, fn: str, model: TrainModule | None, dataloaders: Any, datamodule: DataModule | None,
                   ckpt_path: str | None, verbose: bool) -> list[Any]:
        """validate / test / predict: set up (once per Trainer), attach the data, load the
        checkpoint's weights, and run the evaluation loop on every rank."""
        dataloaders, datamodule = split_datamodule(fn, dataloaders, datamodule)
        model = take_compiled(self._strategy, model, f"Trainer.{fn}")  # Lightning's torch.compile(model)
        if model is None:
            if self.module is None:
                raise TypeError(f"`Trainer.{fn}()` requires a `TrainModule` when it hasn't been passed in a previous "
                                f"run: model=None, and this Trainer has no model yet")
        self._start(fn)
        try:
            verify_stage(self, model if model is not None else self.module, fn)  # before any set-up, as Lightning
            self._setup(model if model is not None else self.module, fn, datamodule)
            self.module.zero_grad()  # as Lightning's stages begin
            hparams.log_hyperparams(self)
            spec = _EVAL_STAGES[fn]
            off = getattr(self, spec.limit) == 0  # as Lightning: no data is requested for a stage limited to 0
            loaders = [] if off else as_loader_list(self._source(spec.loader, dataloaders))
            if not loaders and not off:
                raise ConfigError(f"Trainer.{fn}: no data (pass dataloaders or a datamodule, or implement "
                                  f"{spec.loader}())")
            loaders = [self._prepare_loader(loader, fn) for loader in loaders]
            if fn == "predict":  # Lightning's: each batch's dataset indices, for BasePredictionWriter
                loaders = [with_index_tracking(loader) for loader in loaders]
            # Lightning's trainer.val_dataloaders / test_dataloaders / predict_dataloaders: this stage's
            setattr(self, "val_dataloader" if fn == "validate" else f"{fn}_dataloaders",
                    None if not loaders else loaders[0] if len(loaders) == 1 else loaders)
            path = self.ckpt_path = checkpointing.resume_path(self, ckpt_path, fn, model is not None)
            if path:
                self._load_weights(path)
            self._logging.reset_metrics()
            results = self._evaluate(spec, loaders)
        except BaseException as exc:
            raise self._interrupted(exc, self.module)
        finally:
            self._logging.stop()
            self._stage_teardown(fn)
            self._teardown_data(fn)
        self._finish()
        if verbose and self.is_global_zero and fn != "predict":
            _print_results(fn, results)
        return results[0] if fn == "predict" and len(results) == 1 else results

    def _load_weights(self, path: str) -> None:
        """Collective: an evaluation stage's checkpoint: the model's (and optimizer's) tensors
        only, resharded to this strategy; the loop, callbacks and RNG stay as they are (Lightning
        restores only the model outside ``fit``)."""
        log.info("loading the weights of checkpoint %s", path)
        self._setup_optimizers()  # a checkpoint is read for this model and optimizer (trainer/loop/setup.py)
        checkpointing.load_strategy(self._strategy, self.optimizer, path)
        self._strategy.barrier()

    def _sanity_check(self) -> None:
        """Lightning's sanity check: ``num_sanity_val_steps`` validation batches before the first
        training step (of every fit, resumed ones too), so a broken ``validation_step`` fails fast.
        ``trainer.sanity_checking`` is set meanwhile; its metrics are neither logged nor kept."""
        if not self.num_sanity_val_steps or self.limit_val_batches == 0:
            return
        if not self._validation_defined() or not self._val_data_defined():
            return
        kept = self.state.last_val_step
        self._logging.reset_metrics()
        self.sanity_checking = True
        try:
            with isolate_rng():  # as Lightning: the check leaves the RNG streams (dropout, loader seeds) as they were
                self.hooks("on_sanity_check_start", self, self.module)
                self._run_validation(self._fit_val_loaders())  # the first request of fit's validation data
                self.hooks("on_sanity_check_end", self, self.module)
        finally:
            self.sanity_checking = False
            self.fit_loop.epoch_loop.val_loop.batch_progress.reset()  # as Lightning: the check's batches are not counted
            self._logging.reset_metrics()
            self.state.last_val_step = kept

    # ------------------------------------------------------------------ evaluation
    def _val_loaders(self, given: Any) -> Any:
        """``fit``'s validation data, each loader prepared as the training one: None, one loader, or
        a list of several (a list or dict of loaders; ``validation_step`` gets ``dataloader_idx``)."""
        loaders = [self._overfit(self._prepare_loader(d, "validate"), "val") for d in as_loader_list(given)]
        return None if not loaders else loaders[0] if len(loaders) == 1 else loaders

    @property
    def val_dataloaders(self) -> Any:
        """Lightning's name: ``fit``'s validation loader, or the list of them."""
        return self.val_dataloader

    #: Lightning's: the loader (or list of them) the last ``test`` / ``predict`` ran on
    test_dataloaders: Any = None
    predict_dataloaders: Any = None

    def _validation_defined(self) -> bool:
        """The module has a ``validation_step`` (not the no-op, not set to None: Lightning's way of
        switching validation off), or the strategy validates its own way (pipeline)."""
        return overridden(self.module, "validation_step", TrainModule) or own_schedule(self._strategy)

    def _run_validation(self, loaders: Any) -> list[dict[str, float]]:
        """The validation inside ``fit``: its loader(s), their epoch-level metrics."""
        if not self._validation_defined() or loaders is None:
            return []
        return self._evaluate(_EVAL_STAGES["validate"], loaders if isinstance(loaders, list) else [loaders])

    def _evaluate(self, spec: "_EvalStage", loaders: list) -> list[Any]:
        """One evaluation epoch over ``loaders``, on every rank together (every rank runs every
        forward: a sharded model gathers collectively), under ``torch.inference_mode`` or, with
        ``Trainer(inference_mode=False)``, ``torch.no_grad`` (as Lightning). Returns per loader its
        epoch-level logged metrics (validate, test: Lightning's return value) or its
        ``predict_step`` outputs."""
        self._check_dataloader_idx(spec, len(loaders))
        if not sum(self._count_batches(spec, loaders)):  # as Lightning: no batch, no evaluation hooks
            return []
        grad_off = torch.inference_mode if _inference_mode(self) else torch.no_grad
        before = self.state.stage
        self.state.stage = RunningStage.SANITY_CHECKING if self.sanity_checking else RunningStage(spec.fn)
        try:
            with grad_off():
                return self._evaluate_epoch(spec, loaders)
        finally:
            self.state.stage = before

    #: Lightning's per-loader batch counts of the last (or running) evaluation of each kind, what
    #: the progress bars' totals read (inf: a loader without a length)
    num_sanity_val_batches: list = []
    num_val_batches: list = []
    num_test_batches: list = []
    num_predict_batches: list = []

    def _count_batches(self, spec: "_EvalStage", loaders: list) -> list:
        counts = [self._limit(loader, getattr(self, spec.limit), spec.limit.split("_")[1]) for loader in loaders]
        setattr(self, {"validate": "num_val_batches", "test": "num_test_batches",
                       "predict": "num_predict_batches"}[spec.fn], counts)
        if self.sanity_checking:
            self.num_sanity_val_batches = counts = [min(n, self.num_sanity_val_steps) for n in counts]
        return counts

    def _check_dataloader_idx(self, spec: "_EvalStage", count: int) -> None:
        """Lightning's refusals: several loaders and a step without ``dataloader_idx``, or one loader
        and a step that requires it (no default value)."""
        if own_schedule(self._strategy) or spec.step == "predict_step":
            return
        fn, name = getattr(self.module, spec.step), f"{type(self.module).__name__}.{spec.step}()"
        if count > 1 and not takes(fn, "dataloader_idx"):
            raise RuntimeError(f"You provided multiple `{spec.loader}`, but no `dataloader_idx` argument in "
                               f"`{name}`. Try adding `dataloader_idx=0` to its signature.")
        if count == 1 and takes(fn, "dataloader_idx") and required_without_default(fn, "dataloader_idx"):
            raise RuntimeError(f"You provided only a single `{spec.loader}`, but have included `dataloader_idx` "
                               f"in `{name}`. Either remove the argument or give it a default value i.e. "
                               "`dataloader_idx=0`.")

    def _evaluate_epoch(self, spec: "_EvalStage", loaders: list) -> list[Any]:
        module, mode = self.module, ModelMode(self, spec.fn)
        mode.to_eval()  # on_<stage>_model_eval (trainer/loop/model_mode.py)
        with self._logging.evaluation() as outputs:
            self._eval_loop(spec.fn).batch_progress.reset_on_run()  # trainer/loop/progress.py
            self.hooks.both(f"on_{spec.hooks}_start", self, module)
            self.hooks.both(f"on_{spec.hooks}_epoch_start", self, module)
            results = [self._evaluate_loader(spec, loader, i, len(loaders), outputs)
                       for i, loader in enumerate(loaders)]
            if spec.fn == "validate":
                self.state.last_val_step, self._last_val_time = self.state.global_step, time.monotonic()
            self._logging.eval_epoch_end_reached()
            self.hooks.both(f"on_{spec.hooks}_epoch_end", self, module)
            self._logging.on_epoch_end()
            metrics = self._logging.eval_epoch_end(outputs)
            self.hooks.both(f"on_{spec.hooks}_end", self, module)
        mode.restore()  # every submodule's mode as it was, or on_<stage>_model_train
        return results if spec.fn == "predict" else metrics

    def _evaluate_loader(self, spec: "_EvalStage", loader: Any, index: int, count: int, outputs: list) -> Any:
        """One loader of an evaluation epoch. With several loaders the step gets
        ``dataloader_idx`` and logged names end in ``/dataloader_idx_<i>``, as Lightning's."""
        s = self._strategy
        limit = self._limit(loader, getattr(self, spec.limit))
        if self.sanity_checking:
            limit = min(limit, self.num_sanity_val_steps)
        kwargs = {"dataloader_idx": index} if count > 1 else {}
        self._predicting = spec.fn == "predict"
        job.set_sampler_epoch(loader, self.state.epoch)  # Lightning's: the epochs trained so far
        predictions = []
        loop = self._eval_loop(spec.fn)  # counts the batches (Lightning's batch_progress)
        if self._predicting:
            loop.epoch_batch_indices = loop.epoch_batch_indices[:index] + [[]]

        def run_batch(batch: Any, batch_idx: int) -> Any:
            logs_before = self._logging.log_calls
            self.hooks.mark(spec.step)
            batch = transfer_batch(self, batch, index)  # trainer/data/batch_transfer.py
            self._logging.on_batch_start(batch, index if count > 1 else None)
            if self._predicting:  # trainer/data/predict_indices.py
                loop.current_batch_indices = batch_indices(loader, batch_idx)
                loop.epoch_batch_indices[index].append(loop.current_batch_indices)
            self.hooks.both(f"on_{spec.hooks}_batch_start", self, self.module, batch, batch_idx, *kwargs.values())
            with hook_scope(self, spec.step):
                out = self._eval_forward(spec, batch, batch_idx, kwargs)
                loss = out.get("loss") if isinstance(out, Mapping) else out  # any output is fine
                if not self._predicting and torch.is_tensor(loss) and self._logging.log_calls == logs_before:
                    self._logging.log_loss(spec.loss_name, loss)  # nothing logged: track the loss
            self.hooks.both(f"on_{spec.hooks}_batch_end", self, self.module, out, batch, batch_idx, *kwargs.values())
            self._logging.on_batch_end()
            self._logging.update_eval_step_metrics(index)
            return out

        try:
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                out = loop._evaluation_step(batch, batch_idx, index if count > 1 else None,
                                            lambda b=batch, i=batch_idx: run_batch(b, i))
                if self._predicting:
                    if out is None:  # Lightning's warning, in its words
                        rank_zero_warn("predict returned None if it was on purpose, ignore this warning...")
                    predictions.append(out)
        finally:
            self._predicting = False
        self._logging.store_loader_outputs(outputs)
        return predictions

    def _eval_forward(self, spec: "_EvalStage", batch: Any, batch_idx: int, kwargs: dict[str, int]) -> Any:
        """The module's step through the strategy's model (DDP, ZeRO-3's gathering hooks) under
        the precision's forward context. A strategy that runs its own schedule (the pipeline)
        evaluates its own way: its loss for validate and test; it cannot predict."""
        s = self._strategy
        if own_schedule(s):
            if spec.fn == "predict":
                raise ConfigError(f"Trainer.predict: strategy={s!r} runs its own schedule and returns only "
                                  "the loss; valid: predict under single, ddp or zero1/2/3")
            return s.validation_step(batch, batch_idx)
        if spec.fn == "validate" and not kwargs:
            return s.validation_step(batch, batch_idx)
        return s.run_forward(s.model, spec.step, s.local_batch(batch), batch_idx, **kwargs)  # sequence shard


class _EvalStage(NamedTuple):
    fn: str  # the Trainer method
    step: str  # the TrainModule method run on each batch
    hooks: str  # on_<hooks>_epoch_start / _end
    loader: str  # the TrainModule / DataModule method that gives the data
    limit: str  # the Trainer attribute bounding the batches
    loss_name: str | None  # logged when the step returns a loss and logs nothing


_EVAL_STAGES = {
    "validate": _EvalStage("validate", "validation_step", "validation", "val_dataloader", "limit_val_batches",
                           "val_loss"),
    "test": _EvalStage("test", "test_step", "test", "test_dataloader", "limit_test_batches", "test_loss"),
    "predict": _EvalStage("predict", "predict_step", "predict", "predict_dataloader", "limit_predict_batches",
                          None),
}


def _inference_mode(trainer: Any) -> bool:
    """Evaluate under ``torch.inference_mode``: asked for (the default), and, as Lightning, not with
    the gloo backend (it misbehaves there) nor with a strategy that shards parameters."""
    s = trainer.strategy
    if not trainer.inference_mode or not s.inference_mode_evaluation:
        return False
    return not (s.distributed and torch.distributed.get_backend() == "gloo")


def own_schedule(s: Any) -> bool:
    """The strategy runs every forward of a batch itself (the pipeline): the module's step
    methods never run as such."""
    return bool(s.runs_own_schedule)


def split_datamodule(fn: str, dataloaders: Any, datamodule: DataModule | None,
                      *more_loaders: Any) -> tuple[Any, DataModule | None]:
    """Lightning's ``fit(model, dm)`` / ``test(model, dm)``: a DataModule where the loaders go.
    Loaders and a datamodule together are refused, as Lightning does."""
    if isinstance(dataloaders, DataModule):
        if datamodule is not None:
            raise ConfigError(f"Trainer.{fn}: two datamodules given; valid: one, positionally or as datamodule=")
        dataloaders, datamodule = None, dataloaders
    if datamodule is not None and not isinstance(datamodule, DataModule):
        raise ConfigError(f"Trainer.{fn}: datamodule={type(datamodule).__name__}; valid: a zerotrain.DataModule")
    if datamodule is not None and (dataloaders is not None or any(d is not None for d in more_loaders)):
        raise ConfigError(f"Trainer.{fn}: dataloaders and a datamodule were both given; valid: one of them")
    return dataloaders, datamodule


def as_loader_list(loaders: Any) -> list:
    """A list/tuple of DataLoaders is several loaders, a dict of them too (in its order, as
    Lightning's sequential CombinedLoader); anything else is one."""
    if loaders is None:
        return []
    if isinstance(loaders, Mapping) and loaders and all(isinstance(d, DataLoader) for d in loaders.values()):
        return list(loaders.values())
    if isinstance(loaders, (list, tuple)) and loaders and all(isinstance(d, DataLoader) for d in loaders):
        return list(loaders)
    return [loaders]


def _print_results(fn: str, results: list[dict[str, float]]) -> None:
    """Lightning's ``verbose`` table of a validate / test run (``trainer/loop/results_table.py``)."""
    from ..compat.imports import rich_available
    from .results_table import print_results

    print_results(results, fn, rich=rich_available())


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
