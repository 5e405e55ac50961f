"""A compiled model at the Trainer's and the Engine's doors (``strategies/compile.py`` compiles).

* ``Trainer(compile=True | dict)``: the strategy compiles the model per block after its set-up.
* ``trainer.fit(torch.compile(model))`` (Lightning's form) and ``engine.setup(torch.compile(model))``
  / ``fabric.setup(torch.compile(model))`` (Fabric's): the ``OptimizedModule`` is unwrapped, the
  strategy sets the user's module up, then compiles its blocks with the user's own dynamo context
  (same backend and options). Lightning compiles the step methods whole and Fabric the whole
  wrapped module; here the regions are the blocks under every strategy, so that ZeRO-3's gather
  hooks stay outside the graphs. The module given back (``trainer.lightning_module``, the Engine's
  ``.module``) is the user's own, as Lightning's ``from_compiled`` gives it back.
"""
from __future__ import annotations

from typing import Any

from ...strategies.compile import CompileConfig, unwrap_compiled
from ..errors import ConfigError


def compile_option(owner: str, value: Any) -> CompileConfig | None:
    """``compile=`` checked before any process starts (a ConfigError naming field, value, choices)."""
    try:
        return CompileConfig.parse(value, owner)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def take_compiled(strategy: Any, model: Any, owner: str) -> Any:
    """``model`` without its ``OptimizedModule``; the strategy then compiles with the user's
    context (a ``compile=`` of the Trainer's own is an error: one compile setting)."""
    inner, config = unwrap_compiled(model)
    if config is None:
        return model
    if strategy.compile is not None and strategy.compile.context is not model.dynamo_ctx:
        raise ConfigError(f"{owner}: the model is compiled (torch.compile) and compile={strategy.compile!r} "
                          "was given too; valid: one of them")
    strategy.compile = config
    return inner
