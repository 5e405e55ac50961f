"""The Trainer's evaluation loop: ``validate``, ``test`` and ``predict``, and the validation inside
``fit`` (its sanity check included). Every rank runs every forward together, so a sharded model
(ZeRO-3) gathers collectively; results are returned as Lightning returns them.

``TrainerEvaluation`` is a part of ``Trainer`` (``trainer/trainer.py``), like ``TrainerLogging``:
it reads and sets the Trainer's state (strategy, module, hooks, logging connector, limits,
``sanity_checking``) and holds none of its own.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, NamedTuple

import torch
from torch.utils.data import DataLoader

from . import checkpointing, hparams, job
from .datamodule import DataModule
from .errors import ConfigError
from .logging import hook_scope
from .module import TrainModule

log = logging.getLogger("zerotrain")


class TrainerEvaluation:
    """Lightning's evaluation stages on the Trainer."""

    def validate(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
                 ckpt_path: str | None = None, verbose: bool = True,
                 datamodule: DataModule | None = None) -> list[dict[str, float]]:
        """Run ``validation_step`` over the validation loader(s) on every rank together; returns one
        dict of epoch-level metrics per loader, as Lightning. ``ckpt_path``: as ``test``."""
        return self._run_stage("validate", model, dataloaders, datamodule, ckpt_path, verbose)

    def test(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
             ckpt_path: str | None = None, verbose: bool = True,
             datamodule: DataModule | None = None) -> list[dict[str, float]]:
        """Run ``test_step`` over the test loader(s) on every rank together (a sharded model's
        forward gathers collectively); returns one dict of epoch-level metrics per loader, as
        Lightning. ``ckpt_path``: a checkpoint directory, ``"best"``, ``"last"``/``"latest"`` -
        only the model's weights are loaded; None with no ``model`` means ``"best"``, as Lightning."""
        return self._run_stage("test", model, dataloaders, datamodule, ckpt_path, verbose)

    def predict(self, model: TrainModule | None = None, dataloaders: Iterable | DataModule | None = None,
                datamodule: DataModule | None = None, return_predictions: bool | None = None,
                ckpt_path: str | None = None) -> list[Any] | None:
        """Run ``predict_step`` over the predict loader(s) on every rank together; returns this
        rank's ``predict_step`` outputs in order (a list per loader when there are several), as
        Lightning - or None with ``return_predictions=False``."""
        out = self._run_stage("predict", model, dataloaders, datamodule, ckpt_path, False)
        return out if return_predictions is not False else None

    # ------------------------------------------------------------------ stages
    def _run_stage(self, fn: str, model: TrainModule | None, dataloaders: Any, datamodule: DataModule | None,
                   ckpt_path: str | None, verbose: bool) -> list[Any]:
        """validate / test / predict: set up (once per Trainer), attach the data, load the
        checkpoint's weights, and run the evaluation loop on every rank."""
        dataloaders, datamodule = split_datamodule(fn, dataloaders, datamodule)
        if model is None:
            if self.module is None:
                raise ConfigError(f"Trainer.{fn}: model=None, and this Trainer has no model yet; pass the "
                                  "TrainModule")
            if ckpt_path is None:  # Lightning: the previous fit's best checkpoint, said out loud
                log.warning("Trainer.%s(ckpt_path=None) without a model: the best checkpoint of the previous "
                            "fit is used (pass ckpt_path='best' | 'last' | a directory to silence this)", fn)
                ckpt_path = "best"
        try:
            self._setup(model if model is not None else self.module, fn, datamodule)
            hparams.log_hyperparams(self)
            spec = _EVAL_STAGES[fn]
            self._check_step_defined(spec)
            loaders = _as_loader_list(self._source(spec.loader, dataloaders))
            if not loaders:
                raise ConfigError(f"Trainer.{fn}: no data (pass dataloaders or a datamodule, or implement "
                                  f"{spec.loader}())")
            loaders = [self._prepare_loader(loader, fn) for loader in loaders]
            path = checkpointing.resume_path(self, ckpt_path, fn)
            if path:
                self._load_weights(path)
            self._logging.reset_metrics()
            results = self._evaluate(spec, loaders)
        finally:
            self._logging.stop()
            self._stage_teardown(fn)
            self._teardown_data(fn)
        if verbose and self.is_global_zero and fn != "predict":
            _print_results(fn, results)
        return results[0] if fn == "predict" and len(results) == 1 else results

    def _check_step_defined(self, spec: "_EvalStage") -> None:
        """Lightning refuses ``test`` without a ``test_step`` (and ``validate`` without a
        ``validation_step``); so do we, unless the strategy runs its own schedule (pipeline)."""
        if own_schedule(self._strategy) or spec.step == "predict_step":
            return
        if getattr(type(self.module), spec.step) is getattr(TrainModule, spec.step):
            raise ConfigError(f"Trainer.{spec.fn}: {type(self.module).__name__} does not implement "
                              f"{spec.step}(batch, batch_idx)")

    def _load_weights(self, path: str) -> None:
        """Collective: an evaluation stage's checkpoint: the model's (and optimizer's) tensors
        only, resharded to this strategy; the loop, callbacks and RNG stay as they are (Lightning
        restores only the model outside ``fit``)."""
        log.info("loading the weights of checkpoint %s", path)
        checkpointing.load_strategy(self._strategy, self.optimizer, path)
        self._strategy.barrier()

    def _sanity_check(self) -> None:
        """Lightning's sanity check: ``num_sanity_val_steps`` validation batches before the first
        training step (of every fit, resumed ones too), so a broken ``validation_step`` fails fast.
        ``trainer.sanity_checking`` is set meanwhile; its metrics are neither logged nor kept."""
        if self.val_dataloader is None or not self.num_sanity_val_steps or self.limit_val_batches == 0:
            return
        if getattr(type(self.module), "validation_step") is getattr(TrainModule, "validation_step") and \
                not own_schedule(self._strategy):
            return
        kept = self._last_val_step
        self._logging.reset_metrics()
        self.sanity_checking = True
        try:
            self._run_validation(self.val_dataloader)
        finally:
            self.sanity_checking = False
            self._logging.reset_metrics()
            self._last_val_step = kept

    # ------------------------------------------------------------------ evaluation
    def _run_validation(self, loader: Any) -> dict[str, float]:
        """The validation inside ``fit``: one loader, its epoch-level metrics."""
        return self._evaluate(_EVAL_STAGES["validate"], [loader])[0]

    @torch.no_grad()
    def _evaluate(self, spec: "_EvalStage", loaders: list) -> list[Any]:
        """One evaluation epoch over ``loaders``, on every rank together (every rank runs every
        forward: a sharded model gathers collectively). Returns per loader its epoch-level
        logged metrics (validate, test: Lightning's return value) or its ``predict_step`` outputs."""
        module = self.module
        was_training = module.training
        module.eval()
        with self._logging.evaluation() as outputs:
            self.hooks.both(f"on_{spec.hooks}_start", self, module)
            self.hooks.both(f"on_{spec.hooks}_epoch_start", self, module)
            results = [self._evaluate_loader(spec, loader, i, len(loaders), outputs)
                       for i, loader in enumerate(loaders)]
            if spec.fn == "validate":
                self._last_val_step = self.state.global_step
            self._tick(f"on_{spec.hooks}_epoch_end")
            self._logging.eval_epoch_end_reached()
            self.hooks.both(f"on_{spec.hooks}_epoch_end", self, module)
            self._logging.on_epoch_end()
            metrics = self._logging.eval_epoch_end(outputs)
            self.hooks.both(f"on_{spec.hooks}_end", self, module)
        if was_training:
            module.train()
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
        try:
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= limit:
                    break
                self._val_logged = False
                self._tick(spec.step)
                batch = s.precision.convert_input(to_device(batch, s.device))
                self._logging.on_batch_start(batch, index if count > 1 else None)
                self.hooks.both(f"on_{spec.hooks}_batch_start", self, self.module, batch, batch_idx,
                                *kwargs.values())
                with hook_scope(self, spec.step):
                    out = self._eval_forward(spec, batch, batch_idx, kwargs)
                    loss = out["loss"] if isinstance(out, dict) else out
                    if not self._predicting and torch.is_tensor(loss) and not self._val_logged:
                        self._log_loss(spec.loss_name, loss)  # nothing logged: track the loss
                self.hooks.both(f"on_{spec.hooks}_batch_end", self, self.module, out, batch, batch_idx,
                                *kwargs.values())
                self._logging.on_batch_end()
                self._logging.update_eval_step_metrics(index)
                if self._predicting:
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
        return s.run_forward(s.model, spec.step, batch, batch_idx, **kwargs)


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


def _as_loader_list(loaders: Any) -> list:
    """A list/tuple of DataLoaders is several loaders (Lightning); anything else is one."""
    if loaders is None:
        return []
    if isinstance(loaders, (list, tuple)) and loaders and all(isinstance(d, DataLoader) for d in loaders):
        return list(loaders)
    return [loaders]


def _print_results(fn: str, results: list[dict[str, float]]) -> None:
    """Lightning's ``verbose`` summary of a validate / test run, one block per loader."""
    for i, metrics in enumerate(results):
        title = f"{fn} metrics" + (f" (dataloader {i})" if len(results) > 1 else "")
        print(title + "".join(f"\n  {name}: {value:.6g}" for name, value in sorted(metrics.items())))


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
