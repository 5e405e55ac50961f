"""DeepSpeed's JSON config, read into zerotrain's objects: a strategy (``zero_optimization``), a
precision plugin (``fp16`` / ``bf16``), the optimizer and LR scheduler to build, the batch sizes.

Everything is checked here, before any process group, model or step exists: a key zerotrain
implements with a value it does not support is a :class:`ConfigError` naming the key as DeepSpeed
spells it (``zero_optimization.stage=4: not a ZeRO stage; valid: 0, 1, 2, 3``). Keys zerotrain
does not implement, and keys it accepts but that change nothing here (DeepSpeed's performance knobs
for CUDA kernels, ...), are collected in ``ignored`` and reported once, in one warning
(``report_ignored``), rather than one warning per key or silence.

The meaning of each key is DeepSpeed 0.19.8's (its ``runtime/config.py``, ``runtime/engine.py``,
``runtime/zero/config.py``, ``runtime/lr_schedules.py``); where zerotrain differs on purpose the
README's "Coming from DeepSpeed" section says so. The sections are read in ``sections.py``; this
module builds the optimizer and scheduler specs and assembles the ``DeepSpeedConfig``.
"""
from __future__ import annotations

import base64
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ...errors import ConfigError
from . import lr_schedules
from .defaults import default
from .ops.adam import DeepSpeedAdam, DeepSpeedAdamW, DeepSpeedCPUAdam, FusedAdam
from .precision_keys import torch_autocast_dtype
from .sections import (  # noqa: F401  (re-exported: the sections were read here)
    OFFLOAD_DEVICES, ZERO_STAGES, _communication_dtype, _fail, _flag, _monitoring, _precision, _Reader, _section,
    _sequence_parallel, _tensor_parallel, _whole, _zero, batch_sizes,
)

log = logging.getLogger("zerotrain")

#: DeepSpeed's names (lower-cased, as DeepSpeed compares them) -> what zerotrain builds
_ADAM_NAMES = ("adam", "adamw")
#: DeepSpeed optimizers that are its own kernels, with no torch equivalent here
_UNSUPPORTED_OPTIMIZERS = ("lamb", "lion", "muon", "muadam", "muadamw", "musgd", "onebitadam",
                           "zerooneadam", "onebitlamb")
#: what DeepSpeed's ZeRO runs without ``zero_allow_untested_optimizer`` (its list, with
#: ``deepspeed.ops.adam``'s two as zerotrain has them)
ZERO_TESTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam, DeepSpeedCPUAdam,
                          DeepSpeedAdamW, DeepSpeedAdam)
SCHEDULERS: dict[str, type] = {"WarmupLR": lr_schedules.WarmupLR, "WarmupDecayLR": lr_schedules.WarmupDecayLR,
                               "WarmupCosineLR": lr_schedules.WarmupCosineLR, "OneCycle": lr_schedules.OneCycle,
                               "LRRangeTest": lr_schedules.LRRangeTest}


class DeepSpeedAssertion(ConfigError, AssertionError):
    """A ConfigError where DeepSpeed asserts (``initialize`` without a model, ``step()`` inside
    ``no_sync``, ...): also an AssertionError, so code written against DeepSpeed
    (``pytest.raises(AssertionError)`` in its tests, ``except AssertionError``) sees the refusal it
    expects."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is an error, as in DeepSpeed (which
    would otherwise keep the last one silently)."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"config: duplicate keys {twice}; valid: each key once per section")
    return dict(pairs)


def _parse_text(text: str, where: str) -> Any:
    """JSON, else hjson (JSON with comments, trailing commas, unquoted strings), which DeepSpeed
    reads its config files with; hjson is DeepSpeed's dependency, used here only when installed."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        problem = f"not valid JSON ({exc})"
    try:
        import hjson
    except ImportError:
        raise _fail("config", where, problem, "a JSON object (or hjson, once `pip install hjson`)") from None
    try:
        return json.loads(json.dumps(hjson.loads(text, object_pairs_hook=_no_duplicate_keys)))
    except hjson.HjsonDecodeError as exc:
        raise _fail("config", where, f"{problem}, nor hjson ({exc})", "a JSON or hjson object") from None


def _from_base64(text: str) -> Any:
    """DeepSpeed's third form of ``config``: the config's JSON, base64-encoded (URL-safe), as
    launchers pass it on a command line. None when ``text`` is not that."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeError):
        return None
    return _parse_text(decoded, "<base64>") if decoded.lstrip().startswith("{") else None


def load_config(config: "str | os.PathLike | Mapping[str, Any]") -> dict[str, Any]:
    """The config as a dict: a dict as given (copied), a JSON (or hjson) file's contents, or
    base64-encoded JSON, DeepSpeed's three forms."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep copy that also rejects what JSON cannot hold
    if isinstance(config, (str, os.PathLike)):
        if os.path.isfile(config):
            with open(config) as f:
                raw = _parse_text(f.read(), str(config))
        else:
            raw = _from_base64(config) if isinstance(config, str) else None
            if raw is None:
                raise _fail("config", str(config), "no such file",
                            "a dict, the path of a JSON file, or base64-encoded JSON")
        if not isinstance(raw, dict):
            raise _fail("config", str(config), f"holds a {type(raw).__name__}", "a JSON object")
        return raw
    raise _fail("config", config, "neither a dict nor a path", "a dict or the path of a JSON file")


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer the config's ``optimizer`` section builds: ``cls(params, **kwargs)``."""

    name: str
    cls: type
    kwargs: dict[str, Any]

    def build(self, params: Any) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


@dataclass(frozen=True)
class SchedulerSpec:
    name: str
    cls: type
    kwargs: dict[str, Any]

    def build(self, optimizer: Any) -> Any:
        return self.cls(optimizer, **self.kwargs)


@dataclass(frozen=True)
class ActivationCheckpointing:
    """The ``activation_checkpointing`` section, DeepSpeed's keys; what
    ``deepspeed.checkpointing.configure`` applies (``checkpointing.py`` says what each does here).
    Checks itself: every key's type, and DeepSpeed's two conditions on contiguous buffers."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        for name in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                     "synchronize_checkpoint_boundary", "profile"):
            _flag(f"activation_checkpointing.{name}", getattr(self, name))
        if self.number_checkpoints is not None:
            _whole("activation_checkpointing.number_checkpoints", self.number_checkpoints, 1)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise _fail("activation_checkpointing.contiguous_memory_optimization", True,
                        "contiguous buffers hold partitioned activations only (DeepSpeed's rule)",
                        "false, or partition_activations true")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise _fail("activation_checkpointing.number_checkpoints", None,
                        "contiguous_memory_optimization sizes its buffers by it", "an integer >= 1")


ACTIVATION_CHECKPOINTING_KEYS = tuple(ActivationCheckpointing.__dataclass_fields__)


def activation_checkpointing_spec(raw: Mapping[str, Any], reader: "_Reader | None" = None) -> ActivationCheckpointing:
    """The config's ``activation_checkpointing`` section (DeepSpeed's defaults when absent);
    keys outside it go to ``reader``'s ignored list."""
    section = _section("activation_checkpointing", raw.get("activation_checkpointing") or {})
    if reader is not None:
        reader.take(section, "activation_checkpointing.", ACTIVATION_CHECKPOINTING_KEYS, "activation_checkpointing")
    return ActivationCheckpointing(**{k: section[k] for k in ACTIVATION_CHECKPOINTING_KEYS if k in section})


@dataclass(frozen=True)
class DeepSpeedConfig:
    """A parsed config (``parse``): what the engine is built from."""

    raw: dict[str, Any]
    world_size: int
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float = 1.0  # DeepSpeed 0.19.8's default (defaults.py)
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    #: zerotrain's precision name: "32", "16-mixed" or "bf16-mixed"
    precision: str = "32"
    #: ``torch_autocast``: the type the engine's forward autocasts to, or None
    torch_autocast_dtype: torch.dtype | None = None
    #: the fp16 loss scaler's options (DynamicLossScaler's fields)
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    zero_stage: int = 0
    #: zerotrain's strategy name and its options (``strategy_from_name(strategy, **strategy_options)``)
    strategy: str = "single"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    zero_allow_untested_optimizer: bool = False
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    #: the directory TensorBoard events go to, or None
    tensorboard_dir: str | None = None
    #: ``comms_logger.enabled`` / ``.verbose``: every collective recorded per step
    #: (``deepspeed.comm.log_summary()`` prints them beside the ZeRO formula)
    comms_logger: bool = False
    comms_verbose: bool = False
    dataloader_drop_last: bool = False
    #: the ``activation_checkpointing`` section, checked; applied by ``deepspeed.checkpointing.configure``
    #: (``initialize`` does not apply it, as DeepSpeed's does not)
    activation_checkpointing: ActivationCheckpointing | None = None
    #: "key (why)" for every key that changes nothing here
    ignored: tuple[str, ...] = ()

    @property
    def fp16_enabled(self) -> bool:
        return self.precision == "16-mixed"

    @property
    def bf16_enabled(self) -> bool:
        return self.precision == "bf16-mixed"

    def make_precision(self) -> Any:
        from ....strategies.precision import DynamicLossScaler, FP16Mixed, precision_from_name

        if self.fp16_enabled:
            return FP16Mixed(DynamicLossScaler(**self.loss_scaler))
        return precision_from_name(self.precision)

    def make_strategy(self) -> Any:
        from ....strategies import strategy_from_name

        try:
            return strategy_from_name(self.strategy, **self.strategy_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"zero_optimization: {exc}") from None

    def check_optimizer(self, optimizer: torch.optim.Optimizer, origin: str) -> None:
        """DeepSpeed's rule: under ZeRO an optimizer outside its tested list needs
        ``zero_allow_untested_optimizer``."""
        if self.zero_stage and not self.zero_allow_untested_optimizer and type(optimizer) not in ZERO_TESTED_OPTIMIZERS:
            raise ConfigError(
                f"{origin}={type(optimizer).__name__}: an optimizer DeepSpeed does not test under ZeRO "
                f"(zero_optimization.stage={self.zero_stage}); valid: Adam, AdamW, Adagrad, FusedAdam, "
                "DeepSpeedCPUAdam, or set "
                '"zero_allow_untested_optimizer": true')


def parse(config: "str | os.PathLike | Mapping[str, Any]", world_size: int, sequence_parallel: int = 1) -> DeepSpeedConfig:
    """Read and check ``config`` (a dict or a JSON path) for a job of ``world_size`` processes, of
    which groups of ``sequence_parallel`` share each sample (ALST's mpu): DeepSpeed's batch
    arithmetic and ``world_size`` count data-parallel ranks (world / sp)."""
    raw = load_config(config)
    if not isinstance(raw, dict):
        raise _fail("config", raw, "not a JSON object", "an object of DeepSpeed keys")
    reader = _Reader(raw)
    out: dict[str, Any] = dict(raw=raw, world_size=world_size // sequence_parallel)
    out.update(batch_sizes(raw, world_size // sequence_parallel))
    clip = raw.get("gradient_clipping", default("gradient_clipping"))  # DeepSpeed's 1.0: clipping is on
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        raise _fail("gradient_clipping", clip, "not a number >= 0", "0 (off) or a positive max norm")
    out["gradient_clipping"] = float(clip)
    out.update(_precision(raw, reader))
    master = out.pop("master_dtype", None)  # bf16 masters: ZeRO's master_dtype (stages 1-3, checked)
    out.update(_zero(raw, reader, world_size))
    _tensor_parallel(raw, reader, out)
    _sequence_parallel(raw, sequence_parallel, out)
    if master:
        out["strategy_options"]["master_dtype"] = master
    comm = _communication_dtype(raw, out["precision"])
    if out["strategy"] != "single" and comm != "fp32":  # gradients summed in DeepSpeed's communication_data_type
        out["strategy_options"].setdefault("reduce_dtype", comm)
    out["zero_allow_untested_optimizer"] = _flag("zero_allow_untested_optimizer",
                                                 raw.get("zero_allow_untested_optimizer", default("zero_allow_untested_optimizer")))
    if raw.get("optimizer") is not None:
        out["optimizer"] = optimizer_spec(_section("optimizer", raw["optimizer"]), reader)
        probe = out["optimizer"].build([torch.zeros(1, requires_grad=True)])
        if out["zero_stage"] and not out["zero_allow_untested_optimizer"]:
            DeepSpeedConfig(**out).check_optimizer(probe, "optimizer.type")
    if raw.get("scheduler") is not None:
        out["scheduler"] = scheduler_spec(_section("scheduler", raw["scheduler"]), reader)
    out.update(_monitoring(raw, reader))
    out["dataloader_drop_last"] = _flag("dataloader_drop_last", raw.get("dataloader_drop_last", default("dataloader_drop_last")))
    known = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
             "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization", "zero_allow_untested_optimizer",
             "activation_checkpointing", "steps_per_print", "wall_clock_breakdown", "tensorboard",
             "comms_logger", "dataloader_drop_last", "communication_data_type", "torch_autocast", "tensor_parallel",
             "sequence_parallel_size")
    reader.take(raw, "", known, "")
    out["torch_autocast_dtype"] = torch_autocast_dtype(raw, _flag, reader.ignored)
    if "activation_checkpointing" in raw:
        out["activation_checkpointing"] = activation_checkpointing_spec(raw, reader)
    return DeepSpeedConfig(**out, ignored=tuple(reader.ignored))


def report_ignored(cfg: DeepSpeedConfig) -> None:
    """One warning listing every ignored key (the caller logs it on one rank)."""
    if cfg.ignored:
        log.warning("zerotrain.deepspeed: %d config key(s) ignored: %s", len(cfg.ignored), "; ".join(cfg.ignored))


def optimizer_spec(section: dict[str, Any], reader: _Reader) -> OptimizerSpec:
    """``{"type": ..., "params": {...}}`` -> the torch optimizer DeepSpeed would step on CPU:
    "Adam" is AdamW unless ``adam_w_mode`` is false (DeepSpeed's default, kept), "AdamW" always
    AdamW, "Adagrad" torch's, any other name a ``torch.optim`` class (as DeepSpeed looks it up)."""
    name = section.get("type")
    params = _section("optimizer.params", section.get("params") or {})
    reader.take(section, "optimizer.", ("type", "params"), "optimizer")
    if not isinstance(name, str) or not name:
        raise _fail("optimizer.type", name, "missing", "Adam, AdamW, Adagrad or a torch.optim class name (SGD, ...)")
    if "max_grad_norm" in params:
        raise _fail("optimizer.params.max_grad_norm", params["max_grad_norm"], "not an optimizer parameter",
                    'the top-level "gradient_clipping" key')
    lower = name.lower()
    if lower in _ADAM_NAMES:
        adam_w = _flag("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True))
        # DeepSpeed's switch to torch's Adam (zerotrain always steps torch's): without it DeepSpeed
        # builds FusedAdam / DeepSpeedCPUAdam, whose weight_decay defaults to 0, not AdamW's 0.01
        torch_adam = _flag("optimizer.params.torch_adam", params.pop("torch_adam", False))
        if not torch_adam:
            params.setdefault("weight_decay", default("optimizer.params.weight_decay (Adam, AdamW)"))
        params.pop("fp32_optimizer_states", None)
        if not _flag("optimizer.params.bias_correction", params.pop("bias_correction", True)):
            raise _fail("optimizer.params.bias_correction", False, "not supported (torch's Adam always corrects)",
                        "true")
        adamw = lower == "adamw" or adam_w
        if torch_adam:
            cls = torch.optim.AdamW if adamw else torch.optim.Adam
        else:  # DeepSpeed's FusedAdam: its host kernel's arithmetic on fp32 and bf16 CPU parameters
            cls = DeepSpeedAdamW if adamw else DeepSpeedAdam
    elif lower in _UNSUPPORTED_OPTIMIZERS:
        raise _fail("optimizer.type", name, "a DeepSpeed kernel optimizer zerotrain does not have",
                    "Adam, AdamW, Adagrad or a torch.optim class name (SGD, ...)")
    elif lower == "adagrad":
        cls = torch.optim.Adagrad
    else:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise _fail("optimizer.type", name, "not an optimizer",
                        "Adam, AdamW, Adagrad or a torch.optim class name (SGD, ...)")
    spec = OptimizerSpec(name, cls, params)
    try:
        spec.build([torch.zeros(1, requires_grad=True)])
    except (TypeError, ValueError) as exc:
        raise _fail("optimizer.params", params, f"{cls.__name__} rejects them ({exc})",
                    f"the keyword arguments of torch.optim.{cls.__name__}") from None
    return spec


def scheduler_spec(section: dict[str, Any], reader: _Reader) -> SchedulerSpec:
    name = section.get("type")
    params = _section("scheduler.params", section.get("params") or {})
    reader.take(section, "scheduler.", ("type", "params"), "scheduler")
    if name not in SCHEDULERS:
        raise _fail("scheduler.type", name, "not a supported scheduler", ", ".join(SCHEDULERS))
    warmup = params.get(lr_schedules.WARMUP_TYPE, lr_schedules.WARMUP_LOG_RATE)
    if warmup not in lr_schedules.WARMUP_TYPES:  # the classes fall back to "log" with a warning, as DeepSpeed's
        raise _fail("scheduler.params.warmup_type", warmup, "unknown", ", ".join(lr_schedules.WARMUP_TYPES))
    spec = SchedulerSpec(name, SCHEDULERS[name], params)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        spec.build(probe)
    except (TypeError, ValueError) as exc:
        raise _fail("scheduler.params", params, f"{name} rejects them ({exc})",
                    f"the parameters of DeepSpeed's {name}") from None
    return spec


