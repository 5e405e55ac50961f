"""Typed configuration for the ``zerotrain-train`` command, registered in Hydra's ConfigStore.

Each config group (``strategy``, ``precision``, ``optimizer``, ``model``, ``data``, ``trainer``,
``callbacks``) has a dataclass schema, stored outside the groups as ``schema_<group>[_<option>]``;
the YAML files in ``conf/`` extend them with ``defaults: [/schema_...]``. Hydra then rejects a
misspelt key or a wrongly typed value at compose time, and an unknown option (``strategy=zero9``)
(``train.py`` composes first and reports these in one line, naming the valid choices;
``precision=`` also takes Lightning's aliases: ``train.py`` maps them to the group's options first).

Every value is then range-checked before any process is started, in one place per schema: the
``validate()`` method of each dataclass below (``Config.validate()`` runs them all, plus the checks
that span sections), the strategy's own constructor for the ``strategy`` group (``ZeroConfig``,
``OffloadPolicy``, ...), and ``Trainer.__init__`` for the ``trainer`` options it takes (``train.py``
builds the Trainer before ``fit`` starts the other ranks). Each error is a :class:`ConfigError`
reading ``section.field=value: what is wrong; valid: ...``.

The ``model`` and ``data`` sections are untyped here: each is the user's ``_target_`` and its
arguments (checked against the target's signature, ``trainer/command/hydra_target.py``), or one of the demo's
typed options: the demo GPT's schema and its checks of the model against the data are in
``trainer/command/demo_gpt.py``, its module is built by the ``_target_`` it names in ``examples/``.

Every default is written once, in the library's option dataclasses: the strategy schemas are
generated from each registered preset's dataclasses (``strategies/registry.py``) and the precision
schema from the loss scaler's, so a new option is configurable without writing it twice, and the
YAML files in ``conf/`` only select (a test checks they hold no literal that differs).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ...strategies import Strategy, registry
from ...strategies.precision import PRECISIONS
from ..errors import ConfigError
from ..settings import declaration

_SIMPLE = (int, float, bool, str)


def _bad(field: str, value: Any, problem: str, valid: str) -> ConfigError:
    """The one message format: ``field=value: problem; valid: ...``."""
    return ConfigError(f"{field}={value!r}: {problem}; valid: {valid}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_at_least(field: str, value: Any, least: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < least:
        raise _bad(field, value, f"must be an integer >= {least}",
                   f"{least}, {least + 1}, ..." + (" or null" if allow_none else ""))


def _check_dir(field: str, path: Any) -> None:
    from ...strategies.paths import directory_problem

    problem = directory_problem(path)
    if problem:
        raise _bad(field, path, problem, "a writable directory on a real file system (created if missing)")


def _omegaconf_type(tp: Any) -> Any:
    """The annotation OmegaConf can check, or Any where it cannot (unions of several types,
    callables). ``tp`` may be a string (the option dataclasses use postponed annotations)."""
    if isinstance(tp, str):
        simple = {t.__name__: t for t in _SIMPLE}
        parts = [p.strip() for p in tp.replace("Optional[", "").rstrip("]").split("|")]
        names = [p for p in parts if p != "None"]
        if len(names) == 1 and names[0] in simple:
            t = simple[names[0]]
            return Optional[t] if ("None" in parts or tp.startswith("Optional[")) else t
        return Any
    if tp in _SIMPLE:
        return tp
    args = typing.get_args(tp)
    if len(args) == 2 and type(None) in args and all(a in _SIMPLE for a in args if a is not type(None)):
        return tp  # Optional[int], ...
    return Any


def schema(name: str, options: dict[str, tuple[Any, Any]], bases: tuple[type, ...] = (), **extra: Any) -> type:
    """A typed dataclass for Hydra with one field per option: ``options`` maps a name to its
    (annotation, default), as read from the option dataclasses; nothing is written twice."""
    fields_ = []
    for fname, (tp, default) in options.items():
        if isinstance(default, (list, dict, tuple)):
            fields_.append((fname, Any, field(default_factory=lambda d=default: d)))
        else:
            fields_.append((fname, _omegaconf_type(tp), field(default=default)))
    return dataclasses.make_dataclass(name, fields_, bases=bases, namespace=extra)


def strategy_schema(name: str) -> type:
    """The ``strategy`` group's schema for a registered preset: ``name`` and its options."""
    options = {"name": ("str", name), **registry.get(name).fields()}
    return schema(f"{name.title().replace('_', '')}StrategyConfig", options)


def _validate_precision(self: Any) -> None:
    """The name, then the loss scaler's own checks (it defines the options and their rules)."""
    from ...strategies.precision import DynamicLossScaler, canonical_precision

    try:
        canonical_precision(self.name, field="precision.name")
        DynamicLossScaler(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DynamicLossScaler)})
    except ValueError as exc:
        raise ConfigError(str(exc).replace("DynamicLossScaler: ", "precision.")) from None


def _precision_schema() -> type:
    """``name`` and the dynamic loss scaler's options (16-mixed only), from its dataclass."""
    from ...strategies.precision import DynamicLossScaler

    options = {"name": ("str", "32"), **{f.name: (f.type, f.default) for f in dataclasses.fields(DynamicLossScaler)}}
    return schema("PrecisionConfig", options, validate=_validate_precision)


PrecisionConfig = _precision_schema()


def precision_schema(name: str) -> type:
    """The schema of ``conf/precision/<name>.yaml``: PrecisionConfig selecting ``name``."""
    return schema(f"PrecisionConfig_{name.replace('-', '_')}", {"name": ("str", name)}, bases=(PrecisionConfig,))


OPTIMIZERS = ("adamw",)


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20  # linear warmup, then cosine decay to min_lr_ratio * lr at trainer.max_steps
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        if self.name not in OPTIMIZERS:
            raise _bad("optimizer.name", self.name, "is not an optimizer of the CLI", ", ".join(OPTIMIZERS))
        if not _is_num(self.lr) or self.lr <= 0:
            raise _bad("optimizer.lr", self.lr, "must be > 0", "e.g. 1e-3")
        if not _is_num(self.weight_decay) or self.weight_decay < 0:
            raise _bad("optimizer.weight_decay", self.weight_decay, "must be >= 0", "e.g. 0.1, or 0 for none")
        betas = list(self.betas) if isinstance(self.betas, (list, tuple)) else self.betas
        if not isinstance(betas, list) or len(betas) != 2 or not all(_is_num(b) and 0 <= b < 1 for b in betas):
            raise _bad("optimizer.betas", betas, "must be two numbers, each in [0, 1)", "e.g. [0.9, 0.95]")
        _int_at_least("optimizer.warmup_steps", self.warmup_steps, 0)
        if not _is_num(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            raise _bad("optimizer.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]", "e.g. 0.1")


@dataclass
class DataConfig:
    path: Optional[str] = None  # any text file; None = the Python standard library's source
    max_bytes: int = 4_000_000
    val_fraction: float = 0.05
    batch_size: int = 16  # per data-parallel rank
    num_workers: int = 0

    def validate(self) -> None:
        if self.path is not None:
            from ...strategies.paths import pseudo_filesystem

            valid = "an existing, readable, non-empty text file, or null for the Python standard library"
            if not isinstance(self.path, str) or not os.path.isfile(self.path):
                raise _bad("data.path", self.path, "does not exist or is not a file", valid)
            pseudo = pseudo_filesystem(self.path)
            if pseudo:
                raise _bad("data.path", self.path, pseudo, valid)
            try:
                with open(self.path, "rb") as f:
                    empty = not f.read(1)
            except OSError as exc:
                raise _bad("data.path", self.path, f"cannot be read ({exc.strerror or exc})", valid) from None
            if empty:
                raise _bad("data.path", self.path, "is empty", valid)
        _int_at_least("data.max_bytes", self.max_bytes, 1)
        if not _is_num(self.val_fraction) or not 0 <= self.val_fraction < 1:
            raise _bad("data.val_fraction", self.val_fraction, "must be in [0, 1)",
                       "e.g. 0.05, or 0 for no validation")
        _int_at_least("data.batch_size", self.batch_size, 1)
        _int_at_least("data.num_workers", self.num_workers, 0)

    def size(self) -> int:
        """Bytes the run reads: at most ``max_bytes`` (the standard library has more than that)."""
        return self.max_bytes if self.path is None else min(self.max_bytes, os.path.getsize(self.path))


#: the command line's own defaults where they differ from the Trainer's: a short demo run on 2
#: processes, clipped at 1.0, checkpointed, seeded with 0
CLI_DEFAULTS = {"devices": 2, "max_steps": 150, "gradient_clip_val": 1.0, "val_check_interval": 50,
                "limit_val_batches": 10, "log_every_n_steps": 10, "enable_checkpointing": True,
                "enable_progress_bar": True, "seed": 0, "compile": False}


def _cli_type(f: dataclasses.Field) -> Any:
    """The type OmegaConf checks for a setting: the one the declaration gives the command line
    (``cli=int``), or the setting's own when it is a simple type or an optional one."""
    tp = f.type if f.metadata["cli"] is True else f.metadata["cli"]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return Optional[args[0]] if len(args) == 1 and len(typing.get_args(tp)) == 2 else tp


def _validate_trainer(self: Any) -> None:
    """The declaration's checks of these fields (``trainer/settings/declaration.py``, the Trainer's
    own), worded for the command line; then what the CLI needs beyond the Trainer: ``max_steps``
    >= 1, which the learning-rate schedule decays over, and a seed numpy takes too. What only the
    environment tells (CUDA, several nodes) is checked when ``train.py`` builds the Trainer, before
    any other rank starts."""
    try:
        declaration.check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    except (ConfigError, TypeError) as exc:
        raise ConfigError(str(exc).replace("Trainer: ", "trainer.", 1)) from None
    if not _is_int(self.max_steps) or self.max_steps < 1:
        raise _bad("trainer.max_steps", self.max_steps,
                   "must be an integer >= 1 (the learning-rate schedule decays over it)", "1, 2, ...")
    if self.seed is not None and not 0 <= self.seed < 2**32:
        raise _bad("trainer.seed", self.seed, "must be an integer in [0, 2**32)", "0 .. 4294967295, or null")


def _trainer_schema() -> type:
    """The ``trainer`` section: the settings the declaration marks ``cli``, in its order, typed as
    the command line takes them, with :data:`CLI_DEFAULTS`; nothing re-declared."""
    fields_ = {f.name: (_cli_type(f), CLI_DEFAULTS.get(f.name, f.default))
               for f in dataclasses.fields(declaration.TrainerSettings) if f.metadata["cli"]}
    return schema("TrainerConfig", fields_, validate=_validate_trainer)


TrainerConfig = _trainer_schema()


@dataclass
class CallbacksConfig:
    checkpoint_every_n_steps: Optional[int] = None
    save_last: bool = True
    #: the LearningRateMonitor, writing to the TensorBoard logger (nothing to write to without it)
    lr_monitor: bool = True
    throughput: bool = True
    tensorboard: bool = True
    #: the ResourceMonitor: per-step time breakdown (data, forward, backward, comm wait, ...) and
    #: memory, to the loggers and as a table at the end of fit
    resources: bool = True
    #: with the ResourceMonitor on, global rank 0 writes every rank's per-step records (time parts,
    #: peak RSS) to this JSON file at the end of fit (zerotrain-tune reads its short runs' here)
    resources_json: Optional[str] = None
    #: the FlopsProfiler at this global step (per-module FLOPs and latency, MFU); null: off
    flops_profile_step: Optional[int] = None

    def validate(self) -> None:
        # dirpath (<trainer.default_root_dir or the Hydra run dir>/checkpoints) is checked with the
        # root directory in Config.validate
        _int_at_least("callbacks.checkpoint_every_n_steps", self.checkpoint_every_n_steps, 1, allow_none=True)
        _int_at_least("callbacks.flops_profile_step", self.flops_profile_step, 0, allow_none=True)
        if self.resources_json is not None:  # else found out at the end of fit, after the training
            _check_dir("callbacks.resources_json (its directory)",
                       os.path.dirname(os.path.abspath(self.resources_json)))


@dataclass
class Config:
    strategy: Any = MISSING
    precision: PrecisionConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    model: Any = MISSING  # a `_target_` and its arguments: the user's TrainModule, or the demo GPT's schema
    data: Any = MISSING  # DataConfig (the demo's options), or a user DataModule's _target_ and arguments
    trainer: TrainerConfig = MISSING
    callbacks: CallbacksConfig = MISSING
    ckpt_path: Optional[str] = None  # resume from this checkpoint directory
    sample_tokens: int = 200  # generate this many bytes after training (0: none)
    sample_prompt: str = "def "

    def validate(self) -> None:
        """Every section's checks, then those spanning sections. Raises :class:`ConfigError`."""
        for section in (self.precision, self.optimizer, self.data, self.trainer, self.callbacks):
            if hasattr(section, "validate"):  # not a `_target_` section (trainer/command/hydra_target.py checks those)
                section.validate()
        build_strategy(self.strategy)  # the strategy's constructor checks its fields
        if not _is_int(self.sample_tokens) or self.sample_tokens < 0:
            raise _bad("sample_tokens", self.sample_tokens, "must be an integer >= 0", "0 (no sample), 1, 2, ...")
        if self.sample_tokens and not self.sample_prompt:
            raise _bad("sample_prompt", self.sample_prompt, "must not be empty when sample_tokens > 0",
                       "any text, e.g. 'def '")
        if self.ckpt_path not in (None, "latest") and not os.path.isdir(self.ckpt_path):
            raise _bad("ckpt_path", self.ckpt_path, "is not a directory",
                       "a checkpoint directory, 'latest' (the newest under <root>/checkpoints) or null")
        if self.ckpt_path == "latest" and not self.trainer.enable_checkpointing:
            raise _bad("ckpt_path", self.ckpt_path, "needs trainer.enable_checkpointing=true",
                       "a checkpoint directory, or null")
        self._validate_world()

    def _validate_world(self) -> None:
        """The process count against the strategy; the checks that need the model and the data are
        the demo GPT's (``trainer/command/demo_gpt.py``)."""
        world, strategy = world_size(self.trainer), getattr(self.strategy, "name", None)
        if strategy in ("single", "single_device") and world > 1:
            raise _bad("strategy", strategy, f"runs one process, but trainer.devices x trainer.num_nodes = {world}",
                       "trainer.devices=1, or strategy=ddp (or a zero stage)")


def world_size(trainer: TrainerConfig) -> int:
    """``trainer.devices x trainer.num_nodes``, or 0 while either is not an integer (the Trainer
    then names the bad one)."""
    return trainer.devices * trainer.num_nodes if _is_int(trainer.devices) and _is_int(trainer.num_nodes) else 0


def schema_name(group: str, option: str = "") -> str:
    """The ConfigStore name of a group's schema: a top-level entry (``/schema_strategy_ddp``),
    outside the config groups, so Hydra's ``--help`` and the CLI's list of valid options show only
    the options a user can pick (``conf/<group>/<option>.yaml`` selects it in its defaults)."""
    return f"schema_{group}_{option}" if option else f"schema_{group}"


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name=schema_name("config"), node=Config)
    for name in registry.available():
        cs.store(name=schema_name("strategy", name), node=strategy_schema(name))
    for name in PRECISIONS:  # conf/precision/<name>.yaml selects /schema_precision_<name>
        cs.store(name=schema_name("precision", name), node=precision_schema(name))
    cs.store(name=schema_name("optimizer"), node=OptimizerConfig)
    # group "model": train.py registers the demo GPT's schema (trainer/command/demo_gpt.py)
    cs.store(name=schema_name("data"), node=DataConfig)
    cs.store(name=schema_name("trainer"), node=TrainerConfig)
    cs.store(name=schema_name("callbacks"), node=CallbacksConfig)


# ---------------------------------------------------------------------- building the objects
def build_strategy(cfg: Any) -> Strategy:
    kwargs = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "name"} if dataclasses.is_dataclass(cfg) \
        else {k: v for k, v in dict(cfg).items() if k != "name"}
    name = cfg.name if hasattr(cfg, "name") else cfg["name"]
    try:
        return registry.strategy_from_name(name, **kwargs)
    except (TypeError, ValueError) as exc:
        # "Offload: nvme_path='/x': ..." -> "strategy.nvme_path='/x': ... (strategy=offload)"
        msg = str(exc)
        m = re.match(r"(?:[\w-]+: )?(\w+)=(.*)", msg, re.S)
        if m and m.group(1) in kwargs:
            raise ConfigError(f"strategy.{m.group(1)}={m.group(2)} (strategy={name})") from None
        raise ConfigError(f"strategy={name}: {msg}") from None


def build_precision(cfg: PrecisionConfig):
    from ...strategies.precision import DynamicLossScaler, FP16Mixed, canonical_precision, precision_from_name

    try:
        if canonical_precision(cfg.name, field="precision.name") == "16-mixed":
            return FP16Mixed(DynamicLossScaler(**{f.name: getattr(cfg, f.name)
                                                  for f in dataclasses.fields(DynamicLossScaler)}))
        return precision_from_name(cfg.name)
    except ValueError as exc:
        raise ConfigError(f"precision: {exc}") from None


