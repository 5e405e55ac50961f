"""TrainModule: the user's model, its step, its optimizers and its data, in one nn.Module."""
from __future__ import annotations

import itertools
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...callbacks.base import stage_hooks
from . import conveniences
from ..optim import toggling
from .datamodule import DataHooks
from .hparams import HPARAMS_KEY, HPARAMS_NAME_KEY, HPARAMS_TYPE_KEY, HyperparametersMixin
from ..engine.module_fabric import log_through_fabric
from .module_tools import ModuleTools

if TYPE_CHECKING:
    from ..loop.trainer import Trainer


def _from_trainer(name: str, doc: str) -> property:
    """A Trainer attribute read through the module, 0 when it is not attached (as Lightning)."""
    return property(lambda self: getattr(self._trainer, name) if self._trainer is not None else 0,
                    doc=f"The Trainer's ``{name}``: {doc}; 0 when not attached.")


class TrainModule(HyperparametersMixin, nn.Module, DataHooks, ModuleTools):
    """Subclass and implement ``training_step`` and ``configure_optimizers`` (and optionally the
    data hooks, ``validation_step`` / ``test_step`` / ``predict_step`` and ``configure_model``)."""

    #: Lightning's names of a checkpoint's hyperparameter keys
    CHECKPOINT_HYPER_PARAMS_KEY, CHECKPOINT_HYPER_PARAMS_NAME = HPARAMS_KEY, HPARAMS_NAME_KEY
    CHECKPOINT_HYPER_PARAMS_TYPE = HPARAMS_TYPE_KEY
    _current_fx_name: str | None = None  # the hook or step running now (Lightning's; ``logging.hook_scope``)

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Trainer | None = None

    # ---- what the user implements
    def training_step(self, batch: Any, batch_idx: int) -> "torch.Tensor | dict[str, Any]":
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> "torch.Tensor | dict[str, Any] | None":
        return None

    def test_step(self, batch: Any, batch_idx: int) -> "torch.Tensor | dict[str, Any] | None":
        """``Trainer.test`` runs it on every batch of the test loader(s) (with ``dataloader_idx``
        when there are several); log metrics with ``self.log``. Not overridden: ``test`` refuses."""
        return None

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """``Trainer.predict`` returns what it returns, batch by batch. As Lightning: the forward."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """As Lightning: an optimizer, a list of them, ``([optimizers], [schedulers])``, a dict
        ``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": "step" | "epoch"}}``
        (default interval: epoch) or a list of such dicts; or zerotrain's ``(optimizer,
        scheduler)``, stepped per step. Several optimizers need ``automatic_optimization = False``
        (``trainer/optim/optimization.py``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement configure_optimizers()")

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Automatic optimization calls it for every step (Lightning's hook): override it to act
        around ``optimizer.step(closure=optimizer_closure)``, e.g. a learning-rate warm-up."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Lightning's hook, before the first backward of each accumulation."""
        optimizer.zero_grad()

    def configure_model(self) -> None:
        """Build large layers here instead of ``__init__``: sharded strategies call it on the meta
        device and materialise it shard by shard."""

    def configure_callbacks(self) -> "Any":
        """Callbacks this module needs, added to the Trainer's when it is set up; one whose type
        the Trainer already has (a subclass of) replaces that one, as Lightning's."""
        return []

    # ---- hooks (no-ops): the Trainer calls each after the callbacks' hook of the same name,
    # in Lightning's order (``trainer/loop/hooks.py``)
    def setup(self, stage: str) -> None:
        """At the start of every stage (``"fit" | "validate" | "test" | "predict"``), after the
        datamodule's and the callbacks' ``setup``; before ``configure_model`` on the first."""

    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> "int | None":
        """Return -1 to end the epoch here (the batch is not trained on), as Lightning."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After the first training step of an accumulation, as Lightning; the strategies already
        released the previous step's gradients right after it, so there are none to inspect."""

    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    # on_test_* and on_predict_*: the validation hooks' no-ops under their names (``stage_hooks``)

    # ---- the model's mode around an evaluation (Lightning's hooks; ``trainer/loop/evaluation.py``):
    # ``*_model_eval`` before its start hooks; after its end hooks the mode every submodule had
    # is put back, or, where overridden, ``*_model_train`` runs instead
    def on_validation_model_eval(self) -> None:
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        self.trainer.model.train()

    def on_test_model_eval(self) -> None:
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        self.trainer.model.train()

    def on_predict_model_eval(self) -> None:
        self.trainer.model.eval()

    def on_validation_model_zero_grad(self) -> None:
        """Before a validation inside ``fit`` (not the sanity check): the gradients are released."""
        self.zero_grad()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add this module's extra state to ``checkpoint`` (the checkpoint's metadata: small,
        picklable values; tensors belong in the model's state). Called on global rank 0, which
        writes the metadata."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read back what ``on_save_checkpoint`` added, when ``fit`` resumes."""

    def flops_per_sample(self) -> float | None:
        """Training FLOPs for one sample (forward + backward), for model-FLOPs utilisation."""
        return None

    def tokens_per_sample(self) -> int | None:
        return None

    # ---- what the Trainer provides
    @property
    def trainer(self) -> "Trainer":
        if self._trainer is None and not self._jit_is_scripting:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a `Trainer`.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: "Trainer | None") -> None:
        """Attach (or with None detach) a Trainer, as Lightning's ``model.trainer = trainer``: to
        this module and to every TrainModule among its children (an ensemble's members)."""
        for child in self.children():
            if isinstance(child, TrainModule):
                child.trainer = trainer
        self._trainer = trainer

    #: the Fabric (zerotrain's Engine) that set this module up, weakly held; None otherwise
    _fabric: Any = None

    @property
    def fabric(self) -> Any:
        """Lightning's ``self.fabric``: the Fabric that set this module up (``Fabric.setup``), or None."""
        return self.__dict__.get("_fabric")

    @fabric.setter
    def fabric(self, fabric: Any) -> None:
        """As Lightning: set on every TrainModule among the children too, and held as a weak proxy."""
        for child in self.children():
            if isinstance(child, TrainModule):
                child.fabric = fabric
        if fabric is not None and not isinstance(fabric, weakref.ProxyTypes):
            fabric = weakref.proxy(fabric)
        self.__dict__["_fabric"] = fabric

    @property
    def device_mesh(self) -> Any:
        """Lightning's ``self.device_mesh``: the torch ``DeviceMesh`` a strategy that has one lends the
        module before ``configure_model`` (``ModelParallelStrategy``: dimensions ``"data_parallel"``
        and ``"tensor_parallel"``); None otherwise."""
        return self.__dict__.get("_device_mesh")

    @device_mesh.setter
    def device_mesh(self, mesh: Any) -> None:
        self.__dict__["_device_mesh"] = mesh

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def loggers(self) -> list:
        """The Trainer's loggers (Lightning's ``self.loggers``), or those of the Fabric that set the
        module up (``Fabric.setup``, as Fabric's); ``[]`` when not attached."""
        fabric = self.__dict__.get("_fabric")
        if fabric is not None:
            return fabric.loggers
        return list(self._trainer.loggers) if self._trainer is not None else []

    @property
    def logger(self):
        """The first of the Trainer's loggers, or None (Lightning's ``self.logger``); set up by a
        Fabric: the Fabric's first logger (an IndexError without any, as Fabric's)."""
        if self.fabric is not None:
            return self.fabric.loggers[0]
        return next(iter(self.loggers), None)

    @property
    def strict_loading(self) -> bool:
        """Lightning's: ``load_state_dict``'s ``strict`` in ``load_from_checkpoint`` (default True)."""
        return getattr(self, "_strict_loading", None) in (None, True)

    @strict_loading.setter
    def strict_loading(self, value: bool) -> None:
        self._strict_loading = value

    # ---- manual optimization (Lightning's API; the logic is trainer/optim/optimization.py)
    #: False: ``training_step`` backwards and steps itself (``manual_backward``, ``optimizers()``)
    automatic_optimization = True

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer wrappers (one, or a list for several); ``use_pl_optimizer=False``: the
        optimizers themselves."""
        optim = self.trainer.optimization
        opts = optim.wrappers if use_pl_optimizer else optim.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        """The LR schedulers (None, one, or a list for several), to step yourself in manual mode."""
        scheds = [c.scheduler for c in self.trainer.optimization.schedulers]
        return None if not scheds else scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward(*args, **kwargs)`` as the strategy does it (loss scaling, gradient
        reduction), with the ``on_before_backward``/``on_after_backward`` hooks."""
        self.trainer.optimization.manual_backward(loss, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """How the Trainer runs autograd from a loss (automatic and ``manual_backward``), between
        ``on_before_backward`` and ``on_after_backward``, with the loss already scaled by the
        precision: ``loss.backward(*args, **kwargs)``. Override to backward otherwise."""
        loss.backward(*args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require grad until ``untoggle_optimizer`` (the parameters
        of the Trainer's other optimizers are frozen; each one's previous ``requires_grad`` is kept
        in ``_param_requires_grad_state``), as Lightning's."""
        toggling.toggle(self, optimizer)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Give the other optimizers' parameters back their ``requires_grad``."""
        toggling.untoggle(self, optimizer)

    def toggled_optimizer(self, optimizer: Any) -> Any:
        """``toggle_optimizer``/``untoggle_optimizer`` as a context manager."""
        return toggling.toggled(self, optimizer)

    @property
    def _param_requires_grad_state(self) -> dict:
        """Lightning's: each parameter's ``requires_grad`` before ``toggle_optimizer`` (empty when
        nothing is toggled)."""
        return self.__dict__.setdefault("_requires_grad_before_toggle", {})

    @_param_requires_grad_state.setter
    def _param_requires_grad_state(self, value: dict) -> None:
        self.__dict__["_requires_grad_before_toggle"] = value

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Automatic optimization, before each step (after ``on_before_optimizer_step``), with the
        Trainer's ``gradient_clip_val``/``gradient_clip_algorithm``: override to clip your own way
        through ``self.clip_gradients``. The default clips with the Trainer's values."""
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """How the Trainer steps each scheduler (automatic optimization): ``step()``, or
        ``step(metric)`` for one that monitors a metric (ReduceLROnPlateau)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip ``optimizer``'s gradients (by ``"norm"`` or ``"value"``) at its next ``step()``,
        over the strategy's gradients (partitions where sharded). Set up by a Fabric: its
        ``clip_gradients(module, optimizer, clip_val=, max_norm=)``, as Lightning's."""
        if self.fabric is not None:
            by_value = gradient_clip_algorithm == "value"
            self.fabric.clip_gradients(self, optimizer, clip_val=gradient_clip_val if by_value else None,
                                       max_norm=None if by_value else gradient_clip_val)
            return
        self.trainer.optimization.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
            enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
            add_dataloader_idx: bool = True, batch_size: int | None = None, metric_attribute: str | None = None,
            rank_zero_only: bool = False) -> None:
        """Lightning's ``self.log``: a number or one-element tensor, per step and/or per epoch
        (the defaults depend on the hook, as Lightning's table), the epoch value reduced by
        ``reduce_fx`` (a mean weighted by ``batch_size``, inferred from the batch when not
        given); ``sync_dist`` reduces over ranks (a collective: every rank logs the same names).
        ``trainer/logs/results.py`` and ``trainer/logs/connector.py`` hold the rules. Not attached to a
        Trainer: ignored, as Lightning (which warns); set up by a Fabric: its loggers get the value
        (``module_fabric.py``)."""
        if self.fabric is not None:
            log_through_fabric(self.fabric, {name: value}, logger)
            return
        if self._trainer is None:
            return
        self._trainer.metrics_connector.log(
            name, value, fx=self._current_fx_name, prog_bar=prog_bar, logger=logger, on_step=on_step,
            on_epoch=on_epoch, reduce_fx=reduce_fx, enable_graph=enable_graph, sync_dist=sync_dist,
            sync_dist_group=sync_dist_group, add_dataloader_idx=add_dataloader_idx, batch_size=batch_size,
            metric_attribute=metric_attribute, rank_zero_only=rank_zero_only)

    def log_dict(self, dictionary: "dict[str, Any]", prog_bar: bool = False, logger: bool | None = None,
                 on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean",
                 enable_graph: bool = False, sync_dist: bool = False, sync_dist_group: Any = None,
                 add_dataloader_idx: bool = True, batch_size: int | None = None,
                 rank_zero_only: bool = False) -> None:
        """``self.log`` for each item, with the same options (Lightning's ``log_dict``)."""
        if self.fabric is not None:  # one row for the Fabric's loggers, as Lightning
            log_through_fabric(self.fabric, dictionary, logger)
            return
        for name, value in dictionary.items():
            self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=on_step, on_epoch=on_epoch,
                     reduce_fx=reduce_fx, enable_graph=enable_graph, sync_dist=sync_dist,
                     sync_dist_group=sync_dist_group, add_dataloader_idx=add_dataloader_idx,
                     batch_size=batch_size, rank_zero_only=rank_zero_only)

    # ---- Lightning's module conveniences (hyperparameters: HyperparametersMixin, trainer/api/hparams.py)
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: "str | os.PathLike", map_location: Any = None,
                             hparams_file: "str | os.PathLike | None" = None, strict: bool | None = None,
                             weights_only: bool | None = None, **overrides: Any) -> "TrainModule":
        """This class rebuilt from a checkpoint's saved hyperparameters (updated with
        ``overrides``) and its weights loaded, in this process, for inference: from a sharded
        checkpoint of any strategy and world size, or a consolidated / weights-only file
        (``trainer/api/from_checkpoint.py``). ``map_location``: the device to move it to; ``hparams_file``:
        a ``.yaml``/``.csv`` whose hyperparameters replace the saved ones; ``weights_only``: accepted
        (zerotrain always reads weights-only); ``strict`` (None: ``self.strict_loading``)."""
        from .from_checkpoint import load_from_checkpoint

        return load_from_checkpoint(cls, checkpoint_path, map_location=map_location, strict=strict,
                                    hparams_file=hparams_file, weights_only=weights_only, **overrides)

    @property
    def device(self) -> torch.device:
        """The Trainer's device for this rank; unattached: where the first parameter is (CPU)."""
        if self._trainer is not None:
            return self._trainer.strategy.device
        first = next(itertools.chain(self.parameters(), self.buffers()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter or buffer (the default dtype if none)."""
        return next((t.dtype for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()),
                    torch.get_default_dtype())

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    current_epoch = _from_trainer("current_epoch", "the epoch the loop is in (the one ending, in on_train_epoch_end)")
    local_rank = _from_trainer("local_rank", "this process's rank on its node")

    @property
    def example_input_array(self) -> Any:
        """An example input (Lightning uses it for summaries and graphs); zerotrain only keeps it."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self.__dict__["_example_input_array"] = example

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only, as Lightning (beside the progress bar if one is drawn)."""
        conveniences.rank_zero_print(self._trainer, *args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Collective: a tensor, number or (nested) collection of them from every rank, each
        tensor stacked with a new leading dimension of the world size (of ``group``); one
        process: unchanged (numbers as tensors), as Lightning. ``sync_grads``: differentiable."""
        distributed = self._trainer.strategy.distributed if self._trainer is not None else \
            torch.distributed.is_available() and torch.distributed.is_initialized()
        return conveniences.all_gather(data, self.device, distributed, group=group, sync_grads=sync_grads)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_trainer":  # never register the Trainer as a submodule or pickle it into state
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


stage_hooks(TrainModule)
