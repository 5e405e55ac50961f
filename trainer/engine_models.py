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

from typing import Any

import torch
from torch import nn

from ..strategies import Strategy
from .errors import ConfigError
from .job import plugins


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
        s._before_manual_backward(loss)
        s._before_backward()
    loss.backward()
    for s in touched:
        s._after_backward()
