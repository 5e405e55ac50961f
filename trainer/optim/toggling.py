"""Lightning's ``toggle_optimizer`` / ``untoggle_optimizer`` for a module: while one optimizer is
toggled, only the parameters it steps may require grad; the others are frozen and given their
``requires_grad`` back on untoggle. A parameter in several optimizers (Lightning allows it) stays
trainable for each of them: toggling keeps the flag it had, untoggling restores it through the
other optimizers. The optimizers are the Trainer's (``trainer.optimizers``)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


def _unwrap(optimizer: Any) -> Any:
    return optimizer.__dict__.get("_optimizer", optimizer)  # a LightningOptimizer's optimizer


def _params(module: Any, optimizer: Any) -> Iterator[Any]:
    """The module parameters ``optimizer`` was built on: under a Trainer, those it recorded before a
    strategy re-targeted the groups (ZeRO steps fp32 master slices); else the groups' own."""
    from .optimization import Optimization

    optim = getattr(module.trainer, "optimization", None)
    if isinstance(optim, Optimization):
        for k, opt in enumerate(optim.optimizers):
            if opt is _unwrap(optimizer):
                yield from optim.params[k]
                return
    for group in optimizer.param_groups:
        yield from group["params"]


def toggle(module: Any, optimizer: Any) -> None:
    """Freeze every parameter of the Trainer's optimizers, remembering each one's flag once, then
    give ``optimizer``'s parameters their flag back."""
    before: dict = {}
    for opt in module.trainer.optimizers:
        for p in _params(module, opt):
            if p not in before:
                before[p] = p.requires_grad
                p.requires_grad = False
    for p in _params(module, optimizer):
        p.requires_grad = before.get(p, p.requires_grad)
    module._param_requires_grad_state = before


def untoggle(module: Any, optimizer: Any) -> None:
    """Restore the flags of the other optimizers' parameters and forget them."""
    before = module._param_requires_grad_state
    for opt in module.trainer.optimizers:
        if _unwrap(opt) is _unwrap(optimizer):
            continue
        for p in _params(module, opt):
            if p in before:
                p.requires_grad = before[p]
    module._param_requires_grad_state = {}


@contextlib.contextmanager
def toggled(module: Any, optimizer: Any) -> Iterator[None]:
    toggle(module, optimizer)
    try:
        yield
    finally:
        untoggle(module, optimizer)
