"""Typed configuration for the ``zerotrain-train`` command, registered in Hydra's ConfigStore.

Each config group (``strategy``, ``precision``, ``optimizer``, ``model``, ``data``, ``trainer``,
``callbacks``) has a dataclass schema named ``base_<option>``; the YAML files in ``conf/`` extend
them with ``defaults: [base_...]``. Hydra then rejects a misspelt key or a wrongly typed value at
compose time, and an unknown option (``strategy=zero9``, ``precision=fp8``) with the list of valid
ones. Value checks that need more than a type run when the objects are built (``build_*``), which
``cli.py`` does before any process is started.

Strategy schemas are generated from each registered strategy's constructor signature, so a new
strategy's options are configurable without writing its fields twice.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..examples.gpt import GPTConfig
from ..strategies import Strategy, registry
from .errors import ConfigError

_SIMPLE = (int, float, bool, str)


def _omegaconf_type(tp: Any) -> Any:
    """The annotation OmegaConf can check, or Any where it cannot (unions of several types)."""
    if tp in _SIMPLE:
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union or type(tp).__name__ == "UnionType":
        if len(args) == 1 and args[0] in _SIMPLE:
            return Optional[args[0]]
        if set(args) <= {int, float}:
            return Optional[float] if type(None) in typing.get_args(tp) else float
    return Any


def strategy_schema(name: str, cls: type[Strategy]) -> type:
    """A dataclass with the strategy's constructor keywords (and ``name``) as typed fields."""
    hints = typing.get_type_hints(cls.__init__)
    fields: list[tuple] = [("name", str, field(default=name))]
    for pname, p in inspect.signature(cls.__init__).parameters.items():
        if pname == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = p.default if p.default is not inspect.Parameter.empty else MISSING
        tp = _omegaconf_type(hints.get(pname, Any))
        if isinstance(default, (list, dict, tuple)):
            default, tp = field(default_factory=lambda d=default: d), Any
        fields.append((pname, tp, default if isinstance(default, dataclasses.Field) else field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields)


@dataclass
class PrecisionConfig:
    name: str = "32"
    # dynamic loss scaler (16-mixed only)
    init_scale: float = 2.0**16
    growth_interval: int = 1000
    backoff_factor: float = 0.5
    hysteresis: int = 2
    min_scale: float = 1.0


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass
class DataConfig:
    path: Optional[str] = None  # any text file; None = the Python standard library's source
    max_bytes: int = 4_000_000
    val_fraction: float = 0.05
    batch_size: int = 16  # per data-parallel rank
    num_workers: int = 0


@dataclass
class TrainerConfig:
    accelerator: str = "auto"
    devices: int = 2
    num_nodes: int = 1
    max_steps: int = 150
    max_epochs: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    val_check_interval: Optional[int] = 50
    limit_train_batches: Optional[int] = None
    limit_val_batches: Optional[int] = 10
    log_every_n_steps: int = 10
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    default_root_dir: Optional[str] = None  # None = Hydra's output directory
    seed: int = 0
    deterministic: bool = False
    max_restarts: int = 0  # restart the workers after a failure, resuming from `latest`
    collective_timeout_s: Optional[float] = None  # process-group timeout after the first step


@dataclass
class CallbacksConfig:
    checkpoint_every_n_steps: Optional[int] = None
    save_last: bool = True
    lr_monitor: bool = True
    throughput: bool = True
    tensorboard: bool = True


@dataclass
class Config:
    strategy: Any = MISSING
    precision: PrecisionConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    model: GPTConfig = MISSING
    data: DataConfig = MISSING
    trainer: TrainerConfig = MISSING
    callbacks: CallbacksConfig = MISSING
    ckpt_path: Optional[str] = None  # resume from this checkpoint directory
    sample_tokens: int = 200  # generate this many bytes after training (0: none)
    sample_prompt: str = "def "


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name in registry.available():
        cls = registry.get(name)
        cs.store(group="strategy", name=f"base_{name}", node=strategy_schema(name, cls))
    cs.store(group="precision", name="base_precision", node=PrecisionConfig)
    cs.store(group="optimizer", name="base_optimizer", node=OptimizerConfig)
    cs.store(group="model", name="base_gpt", node=GPTConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="callbacks", name="base_callbacks", node=CallbacksConfig)


# ---------------------------------------------------------------------- building the objects
def build_strategy(cfg: Any) -> Strategy:
    kwargs = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"} if dataclasses.is_dataclass(cfg) \
        else {k: v for k, v in dict(cfg).items() if k != "name"}
    name = cfg.name if hasattr(cfg, "name") else cfg["name"]
    try:
        return registry.strategy_from_name(name, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"strategy={name}: {exc}") from None


def build_precision(cfg: PrecisionConfig):
    from ..strategies.precision import DynamicLossScaler, FP16Mixed, precision_from_name

    try:
        if cfg.name in ("16-mixed", "16"):
            return FP16Mixed(DynamicLossScaler(init_scale=cfg.init_scale, growth_interval=cfg.growth_interval,
                                               backoff_factor=cfg.backoff_factor, hysteresis=cfg.hysteresis,
                                               min_scale=cfg.min_scale))
        return precision_from_name(cfg.name)
    except ValueError as exc:
        raise ConfigError(f"precision: {exc}") from None


def validate_data(cfg: DataConfig) -> None:
    if cfg.batch_size < 1:
        raise ConfigError(f"data.batch_size={cfg.batch_size!r} must be >= 1")
    if cfg.max_bytes < 1:
        raise ConfigError(f"data.max_bytes={cfg.max_bytes!r} must be >= 1")
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.val_fraction!r} must be in [0, 1)")
    if cfg.path is not None:
        import os

        if not os.path.isfile(cfg.path):
            raise ConfigError(f"data.path={cfg.path!r} is not a file")


def validate_optimizer(cfg: OptimizerConfig) -> None:
    if cfg.name != "adamw":
        raise ConfigError(f"optimizer.name={cfg.name!r}; valid choices: adamw")
    if cfg.lr <= 0:
        raise ConfigError(f"optimizer.lr={cfg.lr!r} must be > 0")
