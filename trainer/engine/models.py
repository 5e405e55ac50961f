"""Several models in one Engine (Fabric's ``setup`` called once per model, as a GAN's generator and
discriminator): each model after the first gets a strategy of its own, of the same name and
precision, connected to the same job (the process group is the first's). A backward runs the
strategy-side steps of every model whose parameters the loss reaches (a GAN's discriminator loss
on ``fake.detach()`` reaches the discriminator only), around one autograd pass.

Limits (clear errors): the strategy must be given by name (a Strategy object cannot be copied),
no loss scaling (``16-mixed``: one scale would have to serve several strategies' overflow checks),
and ``save``/``load`` take one model (the checkpoint format holds one strategy's model).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from ...strategies import Strategy
from ..errors import ConfigError
from ..launch.job import plugins


def another_strategy(first: Strategy, spec: Any, precision_spec: Any, precision: Any, world: int) -> Strategy:
    """A strategy like ``first`` (same name and options, same job) for one more model."""
    if not isinstance(spec, str):
        raise ConfigError(f"Engine.setup: a second model with strategy={type(spec).__name__} (an object); valid: "
                          "give the strategy by name to set up several models (each gets its own)")
    if precision.loss_scale != 1.0 or type(precision).__name__ == "FP16Mixed":
        raise ConfigError("Engine.setup: a second model under 16-mixed (loss scaling); valid: precision 32, "
                          "bf16-mixed or bf16-true for several models, or one nn.Module holding them")
    _, strategy = plugins("Engine", spec, precision_spec, world)
    strategy.connect(first.info, first.device, precision)
    strategy.setup_environment()  # the job's group exists: only the strategy's own state
    return strategy


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """``id`` of every leaf tensor ``loss``'s autograd graph accumulates a gradient into."""
    ids: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None:
            ids.add(id(leaf))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return ids


def backward_across(loss: torch.Tensor, models: list[tuple[Strategy, nn.Module]]) -> None:
    """One autograd pass of ``loss`` between the strategy-side steps of each model it reaches
    (a manual backward's: several may follow one forward)."""
    reached = reached_parameters(loss)
    touched = [s for s, m in models if any(id(p) in reached for p in m.parameters())]
    for s in touched:
        s.begin_user_backward(loss)  # the loss scale is 1 (setup refuses 16-mixed for several models)
    models[0][0].precision.backward(loss, None)
    for s in touched:
        s.end_user_backward()


#: a set-up model's methods that run through the strategy as its forward does (Fabric's list)
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class ForwardMethods:
    """Part of the set-up model (``EngineModule``): Fabric's forward methods. On several processes
    ``model.training_step(...)`` (and the other ``STEP_METHODS``, and any method named by
    ``mark_forward_method``) runs through the strategy as a forward (the precision's input
    conversion and autocast, DDP's reducer, ZeRO-3's gathered parameters), not around it; on one
    process it is the module's own method, as under Fabric."""

    def mark_forward_method(self, method: Any) -> None:
        if not isinstance(method, (str, type(self.mark_forward_method))):
            raise TypeError(f"mark_forward_method: method={type(method).__name__}; valid: a method or its name")
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError("mark_forward_method: 'forward' is the forward already; valid: another method's name")
        if not callable(getattr(type(self.module), name, None)):
            raise AttributeError(f"mark_forward_method: {type(self.module).__name__}.{name} is not a method of the "
                                 "model; valid: the name of one of its methods")
        self.__dict__["_forward_methods"].add(name)

    def _watched_method(self, name: str, attr: Any) -> Any:
        """Fabric's refusal of the model's other methods: on several processes a method of the
        module that is not a forward method and runs any of its submodules raises after it returns
        (it ran around the strategy: under ddp no gradient is averaged, under zero3 the parameters
        are gathered outside the forward's schedule, and a call on some ranks only leaves the others
        waiting, as reinforcement_learning's rank-0 ``test`` did). Methods that run no submodule
        (``parameters()``, ``state_dict()``, ...) pass."""
        s = self.__dict__.get("_strategy")
        module = self.__dict__.get("module")
        if s is None or not s.distributed or not inspect.ismethod(attr) or attr.__self__ is not module:
            return attr

        @functools.wraps(attr)
        def watched(*args: Any, **kwargs: Any) -> Any:
            ran: list[nn.Module] = []
            handles = [m.register_forward_hook(lambda m, *_: ran.append(m)) for m in module.modules()]
            try:
                out = attr(*args, **kwargs)
            finally:
                for h in handles:
                    h.remove()
            if ran:
                raise RuntimeError(
                    f"You are calling the method `{type(module).__name__}.{name}()` from outside the model: it ran "
                    f"{type(ran[0]).__name__} around the {s.name} strategy (several processes need every call of "
                    f"the model to go through it); valid: model.mark_forward_method({name!r}) after setup (it "
                    "then runs as the forward), or call the model itself")
            return out
        return watched

    def _forward_method(self, name: str) -> Any:
        """``name`` through the strategy when it is a forward method and the job has several
        processes; else None (the module's own attribute is used)."""
        s = self.__dict__.get("_strategy")
        if s is None or name not in self.__dict__.get("_forward_methods", ()) or not s.distributed:
            return None

        def through_strategy(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = s.precision.convert_input((args, kwargs))
            return s.run_forward(s.model, name, *args, **kwargs)
        return through_strategy
