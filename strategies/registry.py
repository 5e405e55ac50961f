"""Strategy names -> presets. A preset is a builder plus the option dataclasses whose fields are
its options (and the values where the preset differs from their defaults): the Trainer
(``Trainer(strategy="zero2")``) and the CLI's ``strategy`` group (whose schemas are generated from
the same dataclasses, ``trainer/command/config.py``) both build through it. Registering a name makes it
available to both without further change."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .base import PROCESS_GROUP_TIMEOUT_S, Strategy

log = logging.getLogger("zerotrain")


@dataclass(frozen=True)
class Preset:
    #: keyword options -> the strategy
    build: Callable[..., Strategy]
    #: the frozen dataclasses whose fields are this strategy's options
    options: tuple[type, ...] = ()
    #: this preset's values where they differ from the dataclasses' defaults (or are extra fields)
    values: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, tuple[Any, Any]]:
        """Every option: name -> (annotation, default), ``sequence_parallel`` / ``tensor_parallel``
        (where the strategy runs over the mesh's sequence / tensor axis: its ``mesh_axes``) and
        ``process_group_timeout_s`` last."""
        out = {f.name: (f.type, f.default) for cls in self.options for f in dataclasses.fields(cls)}
        for k, v in self.values.items():
            out[k] = (out[k][0] if k in out else type(v).__name__, v)
        for axis in ("sequence", "tensor"):
            if axis in getattr(self.build, "mesh_axes", ()):
                out[f"{axis}_parallel"] = ("int", 1)
        out["process_group_timeout_s"] = ("float", PROCESS_GROUP_TIMEOUT_S)
        return out


_REGISTRY: dict[str, Preset] = {}
#: where the NVMe presets swap when no ``nvme_path`` is given
DEFAULT_NVME_PATH = "/tmp/zerotrain_nvme"


def register(name: str, build: Callable[..., Strategy], options: tuple[type, ...] = (), **values: Any) -> None:
    _REGISTRY[name] = Preset(build, options, values)


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get(name: str) -> Preset:
    _load_builtin()
    if name not in _REGISTRY:
        why = _LIGHTNING_WITHOUT_PRESET.get(name)
        if why:
            raise ValueError(f"strategy={name!r} is Lightning's, with no zerotrain preset: {why}")
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
    register("offload_nvme", Offload, offload, stage=2, optimizer_device="nvme", nvme_path=DEFAULT_NVME_PATH)
    _register_lightning_aliases()


def _register_lightning_aliases() -> None:
    """Lightning's strategy strings, as presets of the equivalent zerotrain strategy (so the CLI
    and ``Trainer(strategy=...)`` both accept them; README.md's "Strategy strings" table lists
    each mapping, and ``_LIGHTNING_WITHOUT_PRESET`` the ones refused, with the reason)."""
    from .ddp import DDP, DDPConfig
    from .offload import Offload, OffloadPolicy
    from .single_device import SingleDevice
    from .zero import BucketConfig, Stage3Config, ZeroConfig, ZeroStage1, ZeroStage2, ZeroStage3

    offload = (ZeroConfig, BucketConfig, Stage3Config, OffloadPolicy)
    register("single_device", SingleDevice)
    register("ddp_find_unused_parameters_true", DDP, (DDPConfig,), find_unused_parameters=True)
    register("ddp_find_unused_parameters_false", DDP, (DDPConfig,), find_unused_parameters=False)
    register("ddp_spawn", _ddp_spawn, (DDPConfig,))
    register("deepspeed", ZeroStage2, (ZeroConfig, BucketConfig))  # Lightning's DeepSpeedStrategy: stage=2
    register("deepspeed_stage_1", ZeroStage1, (ZeroConfig, BucketConfig))
    register("deepspeed_stage_2", ZeroStage2, (ZeroConfig, BucketConfig))
    register("deepspeed_stage_3", ZeroStage3, (ZeroConfig, Stage3Config))
    register("deepspeed_stage_2_offload", Offload, offload, stage=2, optimizer_device="cpu")
    register("deepspeed_stage_3_offload", Offload, offload, stage=3, optimizer_device="cpu", param_device="cpu")
    register("deepspeed_stage_3_offload_nvme", Offload, offload, stage=3, optimizer_device="nvme",
             param_device="nvme", nvme_path=DEFAULT_NVME_PATH)


#: Lightning's strategy strings zerotrain refuses: why, and what to use instead
_LIGHTNING_WITHOUT_PRESET = {
    **{name: "zerotrain starts every rank by re-running the script (no fork or spawn start method); valid: "
             "'ddp' or 'ddp_find_unused_parameters_true'"
       for name in ("ddp_fork", "ddp_notebook", *(f"ddp_{m}_find_unused_parameters_{b}" for m in (
           "spawn", "fork", "notebook") for b in ("true", "false")))},
    "fsdp": "FSDP's full sharding of parameters, gradients and optimizer state is ZeRO stage 3 here; valid: 'zero3'",
    "fsdp_cpu_offload": "FSDP with CPU offload is ZeRO stage 3 with offload here; valid: "
                        "'deepspeed_stage_3_offload' (or Offload(stage=3, optimizer_device='cpu', param_device='cpu'))",
    "xla": "zerotrain runs on CPU and CUDA only; valid: 'ddp' or a ZeRO stage",
}


def _ddp_spawn(**options: Any) -> Strategy:
    """Lightning's ``ddp_spawn`` starts the workers with ``mp.spawn``; zerotrain's launcher re-runs
    the script for each rank instead (as Lightning's ``ddp``). The training is the same DDP, but
    code after ``fit`` runs on every rank, so say so once rather than differ silently."""
    from .ddp import DDP

    log.warning("strategy='ddp_spawn': runs as strategy='ddp' (zerotrain launches each rank by re-running "
                "the script, not with mp.spawn): code after fit() runs on every rank, and fit() returns "
                "in each worker rather than in one parent process")
    return DDP(**options)
