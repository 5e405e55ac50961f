"""Lightning's fine-tuning callbacks: ``BaseFinetuning`` (freeze modules before training, unfreeze
them later and give their parameters to the optimizer as a new group) and ``BackboneFinetuning``
(the module's ``backbone`` unfrozen at an epoch, its learning rate then scheduled)."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm

from ..trainer.errors import ConfigError
from .base import Callback

log = logging.getLogger("zerotrain")


def multiplicative(epoch: int) -> float:
    return 2.0


def _optimizers(trainer: Any) -> list:
    optim = getattr(trainer, "optimization", None)
    found = list(getattr(optim, "optimizers", []) or [])
    return found or ([trainer.optimizer] if trainer.optimizer is not None else [])


class BaseFinetuning(Callback):
    """Subclass and implement ``freeze_before_training(module)`` (run at set-up, before the
    optimizers are made) and ``finetune_function(module, epoch, optimizer)`` (at each training
    epoch's start; call ``unfreeze_and_add_param_group`` there). The optimizer must be stepped as
    given: the strategies that partition it at set-up (zero1/2/3, offload, pipeline) cannot take a
    parameter group added later, and a ``ConfigError`` says so when one is added."""

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._internal_optimizer_metadata = state_dict.get("internal_optimizer_metadata", state_dict)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """A resumed run gets back the parameter groups added before (by parameter name)."""
        if self._restarting and self._internal_optimizer_metadata:
            named = dict(pl_module.named_parameters())
            for idx, optimizer in enumerate(_optimizers(trainer)):
                if idx in self._internal_optimizer_metadata:
                    optimizer.param_groups = _named_groups(self._internal_optimizer_metadata[idx], named)
        self._restarting = False

    # ---- Lightning's static helpers
    @staticmethod
    def flatten_modules(modules: Any) -> list[Module]:
        """The leaf modules (and the modules holding parameters directly) of a module or an
        iterable (or ModuleDict) of them."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found = [m for sub in modules for m in BaseFinetuning.flatten_modules(sub)]
        else:
            found = list(modules.modules())
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Any, train_bn: bool = True, requires_grad: bool = True) -> Iterator[torch.nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (batch-norm
        layers' left out when not ``train_bn``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            yield from (p for p in mod.parameters(recurse=False) if p.requires_grad == requires_grad)

    @staticmethod
    def make_trainable(modules: Any) -> None:
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm):
                mod.track_running_stats = True
            for param in mod.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Any, train_bn: bool = True) -> None:
        """Freeze ``modules`` (their batch-norm layers stay trainable with ``train_bn``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
        """``params`` without those the optimizer already has (with Lightning's warning)."""
        held = [p for group in optimizer.param_groups for p in group["params"]]
        kept, dropped = [], []
        for param in params:
            (dropped if any(torch.equal(p, param) for p in held) else kept).append(param)
        if dropped:
            warnings.warn("The provided params to be frozen already exist within another group of this optimizer. "
                          "Those parameters will be skipped.\nHINT: Did you init your optimizer in "
                          "`configure_optimizer` as such:\n "
                          f"{type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
                          stacklevel=2)
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(modules: Any, optimizer: torch.optim.Optimizer, lr: float | None = None,
                                     initial_denom_lr: float = 10.0, train_bn: bool = True) -> None:
        """Unfreeze ``modules`` and add their new parameters to ``optimizer`` as one group, at
        ``lr`` (default: the first group's learning rate / ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(
            optimizer, BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})

    # ---- the hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        from ..strategies.base import Strategy

        for idx, optimizer in enumerate(_optimizers(trainer)):
            before = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            if len(optimizer.param_groups) != before and \
                    type(trainer.strategy).setup_optimizer is not Strategy.setup_optimizer:
                raise ConfigError(f"{type(self).__name__}: a parameter group was added to the optimizer during "
                                  f"training, and strategy {trainer.strategy.name!r} partitions the optimizer at "
                                  "set-up; valid: strategy='single' or 'ddp' for fine-tuning callbacks")
            self._store(pl_module, idx, before, optimizer.param_groups)

    def _store(self, module: Any, idx: int, before: int, groups: list[dict[str, Any]]) -> None:
        names = {p: n for n, p in module.named_parameters()}
        if idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[idx] = _named_groups(groups, names)
        elif before != len(groups):
            self._internal_optimizer_metadata[idx].extend(_named_groups(groups[before:], names))

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement finetune_function(module, epoch, optimizer)")

    def freeze_before_training(self, pl_module: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement freeze_before_training(module)")


def _named_groups(groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
    """Parameter groups with their parameters replaced through ``mapping`` (to names, or back)."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[p] for p in g["params"]]}
            for g in groups]


class BackboneFinetuning(BaseFinetuning):
    """The module's ``backbone`` (an ``nn.Module``) is frozen until ``unfreeze_backbone_at_epoch``,
    then trained as a new group at ``backbone_initial_lr`` (default: the first group's learning rate
    x ``backbone_initial_ratio_lr``); each later epoch multiplies its rate by
    ``lambda_func(epoch + 1)``, capped at the first group's with ``should_align``."""

    def __init__(self, unfreeze_backbone_at_epoch: int = 10, lambda_func: Callable = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2, backbone_initial_lr: float | None = None,
                 should_align: bool = True, initial_denom_lr: float = 10.0, train_bn: bool = True,
                 verbose: bool = False, rounding: int = 12) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch, self.lambda_func = unfreeze_backbone_at_epoch, lambda_func
        self.backbone_initial_ratio_lr, self.backbone_initial_lr = backbone_initial_ratio_lr, backbone_initial_lr
        self.should_align, self.initial_denom_lr, self.train_bn = should_align, initial_denom_lr, train_bn
        self.verbose, self.rounding = verbose, rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), Module):
            raise ConfigError("The LightningModule should have a nn.Module `backbone` attribute")
        super().on_fit_start(trainer, pl_module)

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            initial = self.backbone_initial_lr if self.backbone_initial_lr is not None \
                else current_lr * self.backbone_initial_ratio_lr
            self.previous_backbone_lr = initial
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial, train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
            backbone_lr = initial
        elif epoch > self.unfreeze_backbone_at_epoch:
            backbone_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
            self.previous_backbone_lr = backbone_lr
        else:
            return
        if self.verbose:
            log.info("Current lr: %s, Backbone lr: %s", round(current_lr, self.rounding),
                     round(backbone_lr, self.rounding))
