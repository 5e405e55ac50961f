"""Strategy names -> classes. Later strategies register themselves here, so the Trainer and the
CLI learn about them without any change."""
from __future__ import annotations

from typing import Any, Callable

from .base import Strategy

_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str, factory: Callable[..., Strategy]) -> None:
    _REGISTRY[name] = factory


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get(name: str) -> Callable[..., Strategy]:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not registered; valid choices: {', '.join(available())}")
    return _REGISTRY[name]


def strategy_from_name(strategy: "str | Strategy", **kwargs: Any) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    _load_builtin()
    if strategy not in _REGISTRY:
        raise ValueError(f"strategy={strategy!r} is not registered; valid choices: {', '.join(available())}")
    return _REGISTRY[strategy](**kwargs)


def _load_builtin() -> None:
    if _REGISTRY:
        return
    from .ddp import DDP
    from .single_device import SingleDevice

    register("single", SingleDevice)
    register("ddp", DDP)
    from .pipeline import PipelineStrategy
    register("pipeline", PipelineStrategy)
    from .zero import register_zero
    register_zero(register)
    from .offload import Offload
    register("offload", Offload)
