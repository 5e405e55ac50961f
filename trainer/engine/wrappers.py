"""What ``Engine.setup`` and ``Engine.setup_dataloaders`` hand back: the model (``EngineModule``),
each optimizer (``EngineOptimizer``) and each loader (``EngineLoader``), thin fronts that route the
user's plain-PyTorch calls (``model(x)``, ``optimizer.step()``, ``for batch in loader``) through the
Engine's strategy and loop position. ``zerotrain.trainer.engine.engine`` re-exports them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from ...strategies import Strategy
from ..errors import ConfigError
from ..launch.job import epoch_iterator
from ..loop.evaluation import to_device as _to_device
from ..loop.state import LoopState
from .models import STEP_METHODS, ForwardMethods

if TYPE_CHECKING:
    from .engine import Engine


class EngineModule(ForwardMethods):
    """The model as ``Engine.setup`` returns it: calling it runs the forward through the strategy
    (``run_forward``: the precision's autocast; the strategy's model: DDP's reducer, ZeRO-3's gather
    hooks), so do its forward methods (``engine_models.ForwardMethods``: ``training_step`` & co.,
    ``mark_forward_method``; other methods running submodules are refused on several processes, as
    Fabric's). Every other attribute is the user's module's (``.module``): ``train()``, ``eval()``,
    ``parameters()`` - under zero3 placeholders outside a forward; read the weights with
    ``engine.strategy.full_state_dict()``."""

    def __init__(self, strategy: Strategy, module: nn.Module) -> None:
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "_strategy", strategy)
        object.__setattr__(self, "_forward_methods", set(STEP_METHODS))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        s = self._strategy
        args, kwargs = s.precision.convert_input((args, kwargs))  # bf16-true: float inputs in bf16, as Fabric's
        return s.run_forward(s.model, "__call__", *args, **kwargs)

    forward = __call__

    @property
    def _forward_module(self) -> nn.Module:
        """Fabric's name for what the strategy runs the forward through (under ddp on several
        processes torch's ``DistributedDataParallel``, e.g. a ``Joinable`` for torch's ``Join``
        with uneven inputs). Its forward takes the step method's name first
        (``strategies/step_wrapper.py``): call the set-up model, not this."""
        return self._strategy.model

    @property
    def _original_module(self) -> nn.Module:
        """Fabric's name for the user's module (``.module``)."""
        return self.module

    @property
    def device(self) -> torch.device:
        """Where the module's parameters are (the strategy's device when it has none), as Fabric's."""
        first = next(self.module.parameters(), None)
        return first.device if first is not None else self._strategy.device

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the complete fp32 weights on global rank 0 (``{}`` elsewhere), whichever
        way the strategy holds them."""
        return self._strategy.full_state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that reaches the strategy's gradients too: ZeRO keeps them in its
        partitions, out of the module's reach (a GAN's ``discriminator.zero_grad()`` left the
        generator loss's gradients there, and the next discriminator step took them)."""
        self._strategy.zero_grad()
        self.module.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        return self._forward_method(name) or self._watched_method(name, getattr(self.module, name))

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.module, name, value)

    def __repr__(self) -> str:
        return f"EngineModule({self._strategy.name}, {self.module!r})"


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer as ``Engine.setup`` returns it: ``step()`` is the strategy's whole step
    (``Strategy.optimizer_step``: gradients ready, unscale and overflow check, the clipping
    ``clip_gradients`` asked for, the inner step of the user's optimizer, parameter refresh, zeroed
    gradients); returns whether it stepped (False: an fp16 overflow skipped it). ``param_groups``
    and every other attribute are the user's optimizer's, so setting ``lr`` and LR schedulers built
    on it work as in plain PyTorch. One of several (``which``): its step and zeroing touch its own
    parameters only; the others' gradients keep accumulating. It is a ``torch.optim.Optimizer``
    (torch's LR schedulers check that) whose ``param_groups``, ``state`` and ``defaults`` are the
    user's optimizer's own (``Optimizer.__init__`` is not run: nothing is copied)."""

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, groups: setattr(self.optimizer, "param_groups", groups))
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def __init__(self, engine: Engine, optimizer: torch.optim.Optimizer, which: int | None = None,
                 strategy: Strategy | None = None) -> None:
        self.engine, self.optimizer, self.which = engine, optimizer, which
        self.strategy = strategy if strategy is not None else engine.strategy  # its model's
        self.clip_at: float | None = None  # set by Engine.clip_gradients for the next step
        self.clip_by, self.clip_error_if_nonfinite = "norm", False  # how it clips ("norm" / "value")
        self.last_grad_norm: torch.Tensor | None = None  # the last step's norm before clipping by norm
        self.clip_norm_out: torch.Tensor | None = None  # what Fabric.clip_gradients returned, filled by step()
        self.dirty = False  # a backward ran since this optimizer's gradients were last zeroed

    def step(self, closure: Any = None) -> bool:
        if closure is not None:
            raise ConfigError("EngineOptimizer.step: closure given; valid: step() without a closure (the "
                              "strategy runs the forward and backward through the engine, not the optimizer)")
        e = self.engine
        try:
            stepped = self.strategy.optimizer_step(self.clip_at, self.clip_by, which=self.which,
                                                   error_if_nonfinite=self.clip_error_if_nonfinite)
        finally:
            self.clip_at, self.clip_by, self.clip_error_if_nonfinite = None, "norm", False
        self.last_grad_norm = getattr(self.strategy, "last_grad_norm", None)
        out, self.clip_norm_out = self.clip_norm_out, None
        if out is not None and self.last_grad_norm is not None:  # Fabric.clip_gradients' returned norm
            out.copy_(self.last_grad_norm.detach())
        self.dirty = False
        e.progress.global_step += 1
        e.progress.skipped_steps += not stepped
        e._after_optimizer_step(self)
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The strategy's gradients dropped (it decides how they are kept; ``set_to_none`` is
        accepted for plain PyTorch's signature). A no-op right after ``step()``, which zeroes."""
        if self.dirty:
            self.strategy.zero_grad(self.which)
            self.dirty = False

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"


class EngineLoader:
    """A loader as ``Engine.setup_dataloaders`` returns it: each pass calls the sampler's
    ``set_epoch``, batches go to the device; the training loader also keeps the position in the
    Engine's ``LoopState`` (epoch, batches of the epoch, as the Trainer counts them) and, after a
    load, its next pass starts at the saved batch."""

    def __init__(self, loader: Any, device: torch.device | None, position: LoopState | None) -> None:
        self.loader, self.device = loader, device
        self.position = position if position is not None else LoopState()
        self._in_pass = False

    @property
    def batch_size(self) -> int | None:
        return getattr(self.loader, "batch_size", None)

    def __getattr__(self, name: str) -> Any:
        """The loader's own attributes (``dataset``, ``sampler``, ``num_workers`` ...), as Fabric's."""
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        pos = self.position
        if self._in_pass:  # the last pass was left unfinished: this one is the next epoch
            pos.epoch, pos.batches_in_epoch = pos.epoch + 1, 0
        skip = pos.batches_in_epoch  # > 0 only when resuming mid-epoch
        if hasattr(getattr(self.loader, "sampler", None), "set_epoch"):
            self.loader.sampler.set_epoch(pos.epoch)
        try:
            total = len(self.loader)
        except TypeError:
            total = None
        self._in_pass = True
        for i, batch in enumerate(epoch_iterator(self.loader, resuming=skip > 0)):
            if i < skip:
                continue
            pos.batches_in_epoch += 1
            pos.total_batches += 1
            if total is not None and i + 1 == total:  # the epoch is over once its last batch is out
                pos.epoch, pos.batches_in_epoch, self._in_pass = pos.epoch + 1, 0, False
            yield _to_device(batch, self.device) if self.device is not None else batch
        if self._in_pass:  # a loader without a length: the epoch ends when it is exhausted
            pos.epoch, pos.batches_in_epoch, self._in_pass = pos.epoch + 1, 0, False
