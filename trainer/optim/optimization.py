"""The Trainer's optimizers and LR schedulers, and Lightning's manual optimization.

``configure_optimizers`` may return what Lightning 2.x accepts - an optimizer, a list of them,
``([optimizers], [schedulers])``, a dict ``{"optimizer", "lr_scheduler", "monitor"}`` or a list of
such dicts - and zerotrain's own ``(optimizer, scheduler)`` (its scheduler stepped per step, as
before). Lightning's forms take Lightning's defaults: a scheduler steps per epoch unless its dict
says ``"interval": "step"``; other keys of an optimizer dict (``frequency``, dropped in Lightning
2.0) are ignored with Lightning's warning.

Several optimizers need manual optimization, as in Lightning 2.x (which raises otherwise). The
strategy then holds them as one :class:`~zerotrain.strategies.optimizers.OptimizerSet`, laid out
and partitioned like one optimizer, and each :class:`ManualOptimizer` (what ``self.optimizers()``
returns) steps and zeroes only its own param groups through ``Strategy.optimizer_step(which=k)``.
In manual optimization, as in Lightning: the Trainer runs ``training_step`` and nothing else; the
user calls ``self.manual_backward(loss)`` (the strategy's backward with loss scaling, between
``on_before_backward``/``on_after_backward``), ``opt.step()`` (``on_before_optimizer_step``, then
the strategy's step of that optimizer, clipped as ``self.clip_gradients`` asked; each step counts
one ``global_step``), ``opt.zero_grad()`` and steps the LR schedulers; ``Trainer(gradient_clip_val=)``
and ``accumulate_grad_batches`` are refused.
"""
from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...strategies.optimizers import OptimizerSet
from ..errors import ConfigError
from ..logs.connector import hook_scope
from .optimizer_config import (MULTIPLE_AUTOMATIC, LRSchedulerConfig, _configure_optimizers,
                               _configure_schedulers_automatic_opt, _configure_schedulers_manual_opt,
                               _init_optimizers_and_lr_schedulers, init_optimizers, parse_optimizers)

#: zerotrain's earlier name of Lightning's LRSchedulerConfig
SchedulerConfig = LRSchedulerConfig

if TYPE_CHECKING:
    from ..loop.trainer import Trainer


def _or_no_op(cfg: Any, module: Any) -> Any:
    """Lightning's ``configure_optimizers`` returning None: said, and the fit runs its steps and
    backwards with an optimizer that changes nothing (SGD with learning rate 0 over the module's
    parameters, standing in for Lightning's mock optimizer)."""
    if cfg is not None:
        return cfg
    warnings.warn("`LightningModule.configure_optimizers` returned `None`, this fit will run with no optimizer",
                  UserWarning, stacklevel=3)
    return torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.0)


def _backward_kwargs(args: tuple, kwargs: dict) -> dict:
    """``Tensor.backward``'s positional arguments (gradient, retain_graph, create_graph, inputs)
    by name, merged with ``kwargs``."""
    return {**dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args)), **kwargs}


class Closure:
    """What the module's ``optimizer_step`` hook gets as ``optimizer_closure`` in automatic
    optimization (Lightning's ``Closure``, under its name): the step's forwards and backwards
    already ran through ``Strategy.run_schedule``, so its first call returns the step's loss;
    each later call (an optimizer that re-evaluates, such as LBFGS) runs ``again``: the
    gradients zeroed, the batch's forward and backward once more, its loss."""

    def __init__(self, loss: Any, again: Callable[[], Any] | None = None) -> None:
        self._loss, self._again, self.calls = loss, again, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._again() if self.calls > 1 and self._again is not None else self._loss


class _Counted:
    """A closure of the user's own, counting its calls as :class:`Closure` does."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn, self.calls = fn, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self._fn()


class Optimization:
    """What the Trainer knows about the module's optimizers: built once at set-up."""

    def __init__(self, trainer: "Trainer", module: Any) -> None:
        self.trainer = trainer
        self.manual = not getattr(module, "automatic_optimization", True)
        self.optimizers, self.schedulers = init_optimizers(module)
        #: each optimizer's module parameters, before a strategy re-targets its groups
        self.params = [[p for g in o.param_groups for p in g["params"]] for o in self.optimizers]
        #: what the strategy holds
        self.held = self.optimizers[0] if len(self.optimizers) == 1 else OptimizerSet(self.optimizers)
        self.wrappers = [ManualOptimizer(o, trainer, k if len(self.optimizers) > 1 else None)
                         for k, o in enumerate(self.optimizers)]
        if self.manual:
            self._check_manual(trainer)

    @staticmethod
    def _check_manual(trainer: "Trainer") -> None:
        """Lightning's refusals for manual optimization, and the strategies that cannot run it."""
        if trainer.gradient_clip_val:
            raise ConfigError("Automatic gradient clipping is not supported for manual optimization. Remove "
                              f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})` or switch to automatic "
                              "optimization.")
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError("Automatic gradient accumulation is not supported for manual optimization. Remove "
                              f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` or switch to "
                              "automatic optimization.")
        if trainer.strategy.runs_own_schedule:
            raise ConfigError(f"strategy={trainer.strategy.name!r} runs every forward and backward of a batch "
                              "itself; valid with automatic_optimization = False: single, ddp, zero1/2/3, "
                              "offload")

    # ------------------------------------------------------------------ schedulers
    @property
    def scheduler(self) -> Any:
        """The first scheduler (the Trainer's ``lr_scheduler``), or None."""
        return self.schedulers[0].scheduler if self.schedulers else None

    def step_schedulers(self, interval: str, plateau: bool, index: int) -> None:
        """Automatic optimization (manual: the user steps them): each scheduler of this interval,
        plateau kind and ``frequency`` (``index``: the epoch's batch index for "step", the epoch
        for "epoch", counted from 0 as Lightning counts them), through the module's
        ``lr_scheduler_step(scheduler, metric)``; a ReduceLROnPlateau gets its monitored metric."""
        if self.manual:
            return
        t = self.trainer
        for c in self.schedulers:
            if c.interval != interval or c.reduce_on_plateau != plateau or (index + 1) % c.frequency:
                continue
            metric = None
            if c.reduce_on_plateau:
                metric = t.fit_loop.epoch_loop._get_monitor_value(c.monitor)  # callback_metrics[monitor]
                if metric is None:
                    where = (f"ReduceLROnPlateau conditioned on metric {c.monitor} which is not available")
                    if c.strict:
                        raise ConfigError(f"{where}. Available metrics are: {list(t.callback_metrics)}. Condition "
                                          "can be set using `monitor` key in lr scheduler dict")
                    warnings.warn(f"{where} but strict is set to `False`. Skipping learning rate update.",
                                  RuntimeWarning, stacklevel=2)
                    continue
            with hook_scope(t, "lr_scheduler_step"):
                t.module.lr_scheduler_step(c.scheduler, metric)

    def clip_for_step(self) -> tuple[float | None, str]:
        """Automatic optimization, before the step: Lightning's ``configure_gradient_clipping(optimizer,
        gradient_clip_val, gradient_clip_algorithm)`` (the default calls ``clip_gradients`` with the
        Trainer's values); returns the (value, algorithm) the step applies."""
        t, wrapper = self.trainer, self.wrappers[0]
        wrapper.clip = None
        with hook_scope(t, "configure_gradient_clipping"):
            t.module.configure_gradient_clipping(self.optimizers[0], gradient_clip_val=t.gradient_clip_val,
                                                 gradient_clip_algorithm=t.gradient_clip_algorithm)
        clip, wrapper.clip = wrapper.clip, None
        return clip or (None, "norm")

    def optimizer_step(self, batch_idx: int) -> bool | None:
        """Automatic optimization's step, through the module's ``optimizer_step(epoch, batch_idx,
        optimizer, optimizer_closure)`` hook (Lightning's; an override such as a learning-rate
        warm-up runs around ``optimizer.step(closure=optimizer_closure)``). The step's forwards
        and backwards already ran, so the closure only returns the loss; ``optimizer.step`` is the
        strategy's step, clipped as ``configure_gradient_clipping`` said. Returns whether it
        stepped (False: an fp16 overflow skip), or None when the hook did not call ``step`` or
        every ``training_step`` of the accumulation returned None (the hook is still called, as
        Lightning's; the gradients are dropped; the step still counts and the schedulers step)."""
        t = self.trainer
        opt = AutomaticOptimizer(t, self.optimizers[0], self.clip_for_step())
        closure = Closure(t.state.step.loss, functools.partial(self._evaluate_again, batch_idx))
        with hook_scope(t, "optimizer_step"):
            t.module.optimizer_step(t.current_epoch, batch_idx, opt, closure)
        if opt.stepped is None:
            t.strategy.skip_step()
        return opt.stepped

    def _evaluate_again(self, batch_idx: int) -> Any:
        """A closure's later call (LBFGS): the gradients zeroed, the last batch's forwards and
        backwards run again through the strategy (hooks and all, as Lightning's closure); its loss."""
        from ..loop.step import BatchHooks

        t = self.trainer
        t.strategy.zero_grad()
        hooks = BatchHooks(t, batch_idx)
        with hook_scope(t, "training_step"):
            t.strategy.run_schedule(t.state.step.batch, batch_idx, hooks)
        return hooks.loss

    def zero_grad_hook(self, batch_idx: int) -> None:
        """The module's ``optimizer_zero_grad(epoch, batch_idx, optimizer)`` where Lightning calls it
        (before the first backward of an accumulation). The strategies release the gradients
        right after each step, so its ``zero_grad`` has nothing left to clear and does nothing (a
        pipeline's schedule has already backwarded when this runs)."""
        t = self.trainer
        opt = AutomaticOptimizer(t, self.optimizers[0], None)
        opt.zero_grad = lambda *args, **kwargs: None  # type: ignore[method-assign]
        with hook_scope(t, "optimizer_zero_grad"):
            t.module.optimizer_zero_grad(t.current_epoch, batch_idx, opt)

    def scheduler_state(self) -> Any:
        """For the checkpoint: one scheduler's state as before, a list for several, or None."""
        states = [c.scheduler.state_dict() for c in self.schedulers]
        return states[0] if len(states) == 1 else (states or None)

    def load_scheduler_state(self, saved: Any) -> None:
        if saved is None or not self.schedulers:
            return
        saved = saved if isinstance(saved, list) else [saved]
        if len(saved) != len(self.schedulers):
            raise ConfigError(f"checkpoint has {len(saved)} LR schedulers; this run configures "
                              f"{len(self.schedulers)}")
        for c, s in zip(self.schedulers, saved):
            c.scheduler.load_state_dict(s)

    # ------------------------------------------------------------------ manual optimization
    def require_manual(self, what: str) -> None:
        if not self.manual:
            raise ConfigError(f"to use {what}, please disable automatic optimization: set "
                              "model.automatic_optimization = False")

    def index_of(self, optimizer: Any) -> int:
        """Which optimizer ``optimizer`` (a user optimizer or its wrapper) is."""
        target = optimizer.optimizer if isinstance(optimizer, ManualOptimizer) else optimizer
        for k, o in enumerate(self.optimizers):
            if o is target:
                return k
        raise ConfigError(f"optimizer={type(target).__name__}: not one configure_optimizers() returned; "
                          "valid: one of self.optimizers()")

    def run_manual_step(self, batch: Any, batch_idx: int) -> Any:
        """Manual optimization's training step, inside the Trainer's ``training_step`` logging
        scope: the step only (it backwards and steps itself, each optimizer step counting one
        ``global_step``); a returned loss is not logged (as Lightning; ``MetricsConnector.log_loss``)."""
        t = self.trainer
        t.hooks.mark("training_step")
        logs_before = t.metrics_connector.log_calls
        out = t.strategy.training_step(batch, batch_idx)
        loss = out.get("loss") if isinstance(out, dict) else out
        if torch.is_tensor(loss) and t.metrics_connector.log_calls == logs_before:
            t.metrics_connector.log_loss("train_loss", loss)
        return out

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The strategy's backward (loss scaling included) between the Trainer's backward hooks;
        ``args``/``kwargs`` (``retain_graph``, ...) go to ``Tensor.backward`` as Lightning's."""
        self.require_manual("manual_backward")
        t = self.trainer
        t.hooks.both("on_before_backward", t, t.module, loss)
        t.strategy.manual_backward(loss, **_backward_kwargs(args, kwargs))
        t.hooks.both("on_after_backward", t, t.module)

    def clip_gradients(self, optimizer: Any, value: float | None, algorithm: str | None) -> None:
        """Lightning's ``clip_gradients`` in manual optimization: the bound is applied over the
        strategy's gradients (partitions where sharded) when this optimizer steps next."""
        t = self.trainer
        if value is None:
            value = t.gradient_clip_val or 0.0
        elif t.gradient_clip_val is not None and t.gradient_clip_val != value:  # Lightning's refusal
            raise ConfigError(f"You have set `Trainer(gradient_clip_val={t.gradient_clip_val!r})` and have passed "
                              f"`clip_gradients(gradient_clip_val={value!r})`. Please use only one of them.")
        given = t._clip_algorithm_given
        if algorithm is None:
            algorithm = given or "norm"
        elif given is not None and given.lower() != algorithm.lower():
            raise ConfigError(f"You have set `Trainer(gradient_clip_algorithm={given!r})` and have passed "
                              f"`clip_gradients(gradient_clip_algorithm={algorithm!r}) Please use only one of them.")
        algorithm = algorithm.lower()
        if algorithm not in ("norm", "value"):
            raise ConfigError(f"gradient_clip_algorithm={algorithm!r}; valid choices: norm, value")
        wrapper = self.wrappers[self.index_of(optimizer)]
        wrapper.clip = (float(value), algorithm) if value else None


_WRAPPER_CLASSES: dict[tuple[type, type], type] = {}


def _rewrap(optimizer: Any, trainer: Any, which: int | None, clip: Any) -> "ManualOptimizer":
    """A pickled ``ManualOptimizer`` again (``ManualOptimizer.__reduce__``)."""
    wrapper = ManualOptimizer(optimizer, trainer, which)
    wrapper.clip = clip
    return wrapper


class ManualOptimizer:
    """Lightning's ``LightningOptimizer`` for zerotrain: ``self.optimizers()`` returns these. Its
    class is made per optimizer class (``LightningSGD``: this class and ``torch.optim.SGD``), so
    ``isinstance(opt, torch.optim.SGD)`` holds and its repr is the optimizer's with ``Lightning``
    in front; every attribute it does not set itself (``state``, ``param_groups``, ``defaults``)
    is the wrapped optimizer's (``_optimizer``). Attached to a Trainer, ``step()`` is the
    strategy's step of this optimizer alone (``which``) and ``zero_grad()`` releases its
    parameters' gradients only; built from an optimizer alone (``LightningOptimizer(opt)``), they
    are the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: "Trainer | None" = None,
                 which: int | None = None) -> None:
        self._optimizer, self._trainer, self.which = optimizer, trainer, which
        self.clip: tuple[float, str] | None = None  # set by clip_gradients for the next step
        own = type(self)
        key = (own, type(optimizer))
        if key not in _WRAPPER_CLASSES and isinstance(optimizer, torch.optim.Optimizer):
            _WRAPPER_CLASSES[key] = type(f"Lightning{type(optimizer).__name__}", (own, type(optimizer)), {})
        self.__class__ = _WRAPPER_CLASSES.get(key, own)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        t = self._trainer
        if t is None:  # not attached: the optimizer's own step
            return self._optimizer.step(closure, **kwargs) if closure is not None else self._optimizer.step(**kwargs)
        out = closure() if closure is not None else None
        t.hooks.both("on_before_optimizer_step", t, t.module, self._optimizer)
        value, algorithm = self.clip or (None, "norm")
        s, s.step_output = t.strategy, None
        if closure is not None:  # the optimizer's step gets it, as Lightning's; it ran already
            kwargs["closure"] = lambda: out
        s.optimizer_step(value, algorithm, which=self.which, zero_grad=False, step_kwargs=kwargs)
        self.clip = None
        t.state.global_step += 1
        return out if s.step_output is None else s.step_output  # the optimizer's own return, as Lightning

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._trainer is None:
            self._optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self._trainer.strategy.zero_grad(self.which)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def __reduce__(self) -> tuple:
        """Pickled as what it wraps (its class is made at run time, so pickle cannot name it): a
        Trainer and what holds it (the progress bar, Lightning's test) pickle after ``fit``."""
        return _rewrap, (self._optimizer, self._trainer, self.which, self.clip)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Into the wrapped optimizer (what the strategy steps)."""
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self._optimizer, name)


class AutomaticOptimizer(ManualOptimizer):
    """What the module's ``optimizer_step``/``optimizer_zero_grad`` hooks get in automatic
    optimization (Lightning's ``LightningOptimizer`` there): ``step`` runs the closure, then the
    strategy's step (the Trainer counts it); other attributes are the user's optimizer's."""

    def __init__(self, trainer: "Trainer", optimizer: torch.optim.Optimizer, clip: Any) -> None:
        super().__init__(optimizer, trainer, None)
        self.clip, self.stepped = clip, None

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """The strategy's step; the closure goes to the user's ``optimizer.step(closure=...)`` as
        Lightning's (an LBFGS calls it again to re-evaluate), and what that returns comes back."""
        t = self._trainer
        if self.stepped is not None or not t.state.step.backward_ran:  # nothing (more) to step on
            return closure() if closure is not None else None
        counted = closure if isinstance(closure, Closure) or closure is None else _Counted(closure)
        if counted is not None:
            kwargs["closure"] = counted
        s, s.step_output = t.strategy, None
        self.stepped = s.optimizer_step(*(self.clip or (None, "norm")), step_kwargs=kwargs)
        if counted is not None and not counted.calls:  # a strategy that steps its own copy (ZeRO)
            return counted()
        return s.step_output


#: Lightning's name (``zerotrain.core.optimizer.LightningOptimizer``) for what ``self.optimizers()`` returns
LightningOptimizer = ManualOptimizer
