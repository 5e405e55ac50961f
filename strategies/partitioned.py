"""Which strategy holds a module's parameters partitioned (ZeRO-3: outside a step each parameter
is a NaN placeholder of its shape and only that strategy's units hold the values).

A second ``fit`` on the same Trainer continues on the same strategy. A *new* strategy (another
Trainer or Engine given the same module) would read the placeholders as weights and train on NaN,
so its set-up refuses the module with what to do instead."""
from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from ..trainer.errors import ConfigError

_ATTR = "_zerotrain_partitioned_by"


def mark(module: nn.Module, strategy: Any) -> None:
    """``strategy`` now holds ``module``'s parameters partitioned (for good: nothing unshards them)."""
    module.__dict__[_ATTR] = (strategy.name, weakref.ref(strategy))


def refuse_other(module: nn.Module, strategy: Any) -> None:
    """Raise ConfigError when ``module`` is held partitioned by a strategy other than ``strategy``
    (or by one since garbage-collected: the placeholders stay)."""
    held = module.__dict__.get(_ATTR)
    if held is not None and held[1]() is not strategy:
        raise ConfigError(
            f"{type(module).__name__}'s parameters are partitioned by the {held[0]} strategy of an earlier "
            f"Trainer/Engine (outside it they read as NaN placeholders), so {strategy.name} cannot set it up: "
            "fit again on that Trainer (raise max_steps / max_epochs), or build a new module and load "
            "the weights from that Trainer's full_state_dict() or a checkpoint")
