"""Strategy names -> presets. A preset is a builder plus the option dataclasses whose fields are
its options (and the values where the preset differs from their defaults): the Trainer
(``Trainer(strategy="zero2")``) and the CLI's ``strategy`` group (whose schemas are generated from
the same dataclasses, ``trainer/config.py``) both build through it. Registering a name makes it
available to both without further change."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .base import PROCESS_GROUP_TIMEOUT_S, Strategy


@dataclass(frozen=True)
class Preset:
    #: keyword options -> the strategy
    build: Callable[..., Strategy]
    #: the frozen dataclasses whose fields are this strategy's options
    options: tuple[type, ...] = ()
    #: this preset's values where they differ from the dataclasses' defaults (or are extra fields)
    values: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, tuple[Any, Any]]:
        """Every option: name -> (annotation, default), ``process_group_timeout_s`` last."""
        out = {f.name: (f.type, f.default) for cls in self.options for f in dataclasses.fields(cls)}
        for k, v in self.values.items():
            out[k] = (out[k][0] if k in out else type(v).__name__, v)
        out["process_group_timeout_s"] = ("float", PROCESS_GROUP_TIMEOUT_S)
        return out


_REGISTRY: dict[str, Preset] = {}


def register(name: str, build: Callable[..., Strategy], options: tuple[type, ...] = (), **values: Any) -> None:
    _REGISTRY[name] = Preset(build, options, values)


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get(name: str) -> Preset:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not registered; valid choices: {', '.join(available())}")
    return _REGISTRY[name]


def strategy_from_name(strategy: "str | Strategy", **kwargs: Any) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    preset = get(strategy)
    return preset.build(**{**preset.values, **kwargs})


def _load_builtin() -> None:
    if _REGISTRY:
        return
    from .ddp import DDP, DDPConfig
    from .offload import Offload, OffloadPolicy
    from .pipeline import PipelineConfig, PipelineStrategy
    from .single_device import SingleDevice
    from .zero import BucketConfig, Stage3Config, ZeroConfig, ZeroStage1, ZeroStage2, ZeroStage3

    register("single", SingleDevice)
    register("ddp", DDP, (DDPConfig,))
    register("pipeline", PipelineStrategy, (PipelineConfig,))
    register("zero1", ZeroStage1, (ZeroConfig, BucketConfig))
    register("zero2", ZeroStage2, (ZeroConfig, BucketConfig))
    register("zero3", ZeroStage3, (ZeroConfig, Stage3Config))
    offload = (ZeroConfig, BucketConfig, Stage3Config, OffloadPolicy)
    register("offload", Offload, offload, stage=2)
    register("offload_cpu", Offload, offload, stage=2, optimizer_device="cpu")
    register("offload_nvme", Offload, offload, stage=2, optimizer_device="nvme", nvme_path="/tmp/zerotrain_nvme")
