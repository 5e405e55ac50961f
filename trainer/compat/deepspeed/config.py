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
README's "Coming from DeepSpeed" section says so.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ...errors import ConfigError
from . import lr_schedules
from .defaults import default
from .ops.adam import DeepSpeedCPUAdam, FusedAdam
from .precision_keys import check_bf16_keys, torch_autocast_dtype

log = logging.getLogger("zerotrain")

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: DeepSpeed's names (lower-cased, as DeepSpeed compares them) -> what zerotrain builds
_ADAM_NAMES = ("adam", "adamw")
#: DeepSpeed optimizers that are its own kernels, with no torch equivalent here
_UNSUPPORTED_OPTIMIZERS = ("lamb", "lion", "muon", "muadam", "muadamw", "musgd", "onebitadam",
                           "zerooneadam", "onebitlamb")
#: what DeepSpeed's ZeRO runs without ``zero_allow_untested_optimizer`` (its list, with
#: ``deepspeed.ops.adam``'s two as zerotrain has them)
ZERO_TESTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam, DeepSpeedCPUAdam)
SCHEDULERS: dict[str, type] = {"WarmupLR": lr_schedules.WarmupLR, "WarmupDecayLR": lr_schedules.WarmupDecayLR,
                               "WarmupCosineLR": lr_schedules.WarmupCosineLR}

# Keys zerotrain accepts whose effect DeepSpeed needs and zerotrain does not (they tune DeepSpeed's
# own kernels or buffers, or its CUDA memory layout); the training is the same without them.
_NO_EFFECT = {
    "zero_optimization": ("contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
                          "elastic_checkpoint", "load_from_fp32_weights",
                          "ignore_unused_parameters", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
                          "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                          "sub_group_size"),
    "offload_optimizer": ("fast_init", "ratio", "pipeline_read", "pipeline_write"),
    "offload_param": ("buffer_size", "max_in_cpu"),
    "fp16": ("auto_cast", "fp16_master_weights_and_grads"),
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
    "comms_logger": ("debug", "prof_ops"),
    "": ("zero_force_ds_cpu_optimizer", "prescale_gradients", "gradient_predivide_factor", "memory_breakdown"),
}


def _fail(key: str, value: Any, problem: str, valid: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {problem}; valid: {valid}")


def _whole(key: str, value: Any, least: int) -> int:
    """An integer >= ``least``; integral floats (``5e8``, as JSON configs write sizes) too."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value != int(value):
        raise _fail(key, value, "not a whole number", f"an integer >= {least}")
    if value < least:
        raise _fail(key, value, "too small", f"an integer >= {least}")
    return int(value)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, value, "not a boolean", "true or false")
    return value


def _section(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(key, value, "not a JSON object", "an object of options")
    return dict(value)


def load_config(config: "str | os.PathLike | Mapping[str, Any]") -> dict[str, Any]:
    """The config as a dict: a dict as given (copied), or a JSON file's contents."""
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))  # a deep copy that also rejects what JSON cannot hold
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise _fail("config", str(config), "no such file", "a dict or the path of a JSON file")
        with open(config) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as exc:
                raise _fail("config", str(config), f"not valid JSON ({exc})", "a JSON object") from None
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


# ---------------------------------------------------------------------------- parsing
class _Reader:
    """Walks the config, taking the keys it knows and remembering the rest as ignored."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw, self.ignored = raw, []

    def take(self, section: dict[str, Any], prefix: str, known: tuple[str, ...], no_effect_of: str) -> None:
        """Every key of ``section`` not in ``known`` is ignored: "no effect" when listed so."""
        quiet = _NO_EFFECT.get(no_effect_of, ())
        for key in section:
            if key not in known:
                why = "no effect in zerotrain" if key in quiet else "not implemented"
                self.ignored.append(f"{prefix}{key} ({why})")


def parse(config: "str | os.PathLike | Mapping[str, Any]", world_size: int) -> DeepSpeedConfig:
    """Read and check ``config`` (a dict or a JSON path) for a job of ``world_size`` processes."""
    raw = load_config(config)
    if not isinstance(raw, dict):
        raise _fail("config", raw, "not a JSON object", "an object of DeepSpeed keys")
    reader = _Reader(raw)
    out: dict[str, Any] = dict(raw=raw, world_size=world_size)
    out.update(batch_sizes(raw, world_size))
    clip = raw.get("gradient_clipping", default("gradient_clipping"))  # DeepSpeed's 1.0: clipping is on
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        raise _fail("gradient_clipping", clip, "not a number >= 0", "0 (off) or a positive max norm")
    out["gradient_clipping"] = float(clip)
    out.update(_precision(raw, reader))
    out.update(_zero(raw, reader, world_size))
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
             "comms_logger", "dataloader_drop_last", "communication_data_type", "torch_autocast")
    reader.take(raw, "", known, "")
    out["torch_autocast_dtype"] = torch_autocast_dtype(raw, _flag, reader.ignored)
    if "activation_checkpointing" in raw:
        out["activation_checkpointing"] = activation_checkpointing_spec(raw, reader)
    return DeepSpeedConfig(**out, ignored=tuple(reader.ignored))


def _communication_dtype(raw: Mapping[str, Any], precision: str) -> str:
    """DeepSpeed's ``communication_data_type`` (``fp32`` / ``fp16`` / ``bf16``, any case); unset, its
    engine uses the 16-bit training type under fp16/bf16 and fp32 otherwise."""
    value = raw.get("communication_data_type", default("communication_data_type"))
    if value is None:
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, "fp32")
    if not isinstance(value, str) or value.lower() not in ("fp32", "fp16", "bf16"):
        raise _fail("communication_data_type", value, "not a data type DeepSpeed communicates in", "fp32, fp16, bf16")
    return value.lower()


def report_ignored(cfg: DeepSpeedConfig) -> None:
    """One warning listing every ignored key (the caller logs it on one rank)."""
    if cfg.ignored:
        log.warning("zerotrain.deepspeed: %d config key(s) ignored: %s", len(cfg.ignored), "; ".join(cfg.ignored))


def batch_sizes(raw: Mapping[str, Any], world_size: int) -> dict[str, int]:
    """DeepSpeed's batch arithmetic: ``train_batch_size = micro * accumulation * world``; any two
    of the three determine the third, one of train/micro alone sets accumulation to 1; the three
    must then agree exactly."""
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    train, micro, gas = (None if raw.get(n) is None else _whole(n, raw[n], 1) for n in names)
    if train is None and micro is None:
        raise ConfigError(f"train_batch_size=None, train_micro_batch_size_per_gpu=None: neither is given; valid: "
                          "either of them (with gradient_accumulation_steps, or both)")
    if micro is None:
        gas = gas or 1
        micro = train // world_size // gas
    elif train is None:
        gas = gas or 1
        train = micro * gas * world_size
    elif gas is None:
        gas = train // micro // world_size
    if micro < 1 or gas < 1 or train != micro * gas * world_size:
        raise ConfigError(
            f"train_batch_size={train}: not train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps "
            f"({gas}) x world size ({world_size}); valid: train_batch_size = micro x accumulation x world size")
    return {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}


def _precision(raw: Mapping[str, Any], reader: _Reader) -> dict[str, Any]:
    fp16 = _section("fp16", raw.get("fp16", {}))
    bf16_key = "bf16" if "bf16" in raw else "bfloat16"
    bf16 = _section(bf16_key, raw.get(bf16_key, {}))
    fp16_on = _flag("fp16.enabled", fp16.get("enabled", False))
    bf16_on = _flag(f"{bf16_key}.enabled", bf16.get("enabled", False))
    reader.take(bf16, f"{bf16_key}.", ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states"), "bf16")
    if fp16_on and bf16_on:
        raise ConfigError(f"fp16.enabled=True, {bf16_key}.enabled=True: both; valid: at most one of them")
    if not fp16_on:
        reader.take(fp16, "fp16.", ("enabled",), "fp16")
        check_bf16_keys(raw, bf16_key, _flag, reader.ignored) if bf16_on else None
        return {"precision": "bf16-mixed" if bf16_on else "32"}
    if fp16.get("loss_scale", 0) != 0:
        raise _fail("fp16.loss_scale", fp16["loss_scale"], "a static loss scale is not supported",
                    "0 (dynamic loss scaling)")
    if fp16.get("consecutive_hysteresis", False):
        raise _fail("fp16.consecutive_hysteresis", True, "not supported (hysteresis refills when the scale grows)",
                    "false")
    power = _whole("fp16.initial_scale_power", fp16.get("initial_scale_power", default("fp16.initial_scale_power")), 0)
    scaler = {"init_scale": 2.0 ** power,
              "growth_interval": _whole("fp16.loss_scale_window", fp16.get("loss_scale_window", default("fp16.loss_scale_window")), 1),
              "hysteresis": _whole("fp16.hysteresis", fp16.get("hysteresis", default("fp16.hysteresis")), 1),
              "min_scale": float(fp16.get("min_loss_scale", default("fp16.min_loss_scale")))}
    if not scaler["min_scale"] > 0 or scaler["min_scale"] > scaler["init_scale"]:
        raise _fail("fp16.min_loss_scale", fp16.get("min_loss_scale"), "out of range",
                    f"a number in (0, 2**initial_scale_power = {scaler['init_scale']}]")
    reader.take(fp16, "fp16.", ("enabled", "loss_scale", "consecutive_hysteresis", "initial_scale_power",
                                "loss_scale_window", "hysteresis", "min_loss_scale"), "fp16")
    return {"precision": "16-mixed", "loss_scaler": scaler}


def _offload(zero: Mapping[str, Any], which: str, reader: _Reader) -> dict[str, Any]:
    """``offload_optimizer`` / ``offload_param``: device and where it swaps; {} when off."""
    key = f"zero_optimization.{which}"
    section = _section(key, zero.get(which) or {})
    device = section.get("device", "none")
    if device not in OFFLOAD_DEVICES:
        raise _fail(f"{key}.device", device, "not an offload device", ", ".join(OFFLOAD_DEVICES))
    reader.take(section, f"{key}.", ("device", "nvme_path", "pin_memory", "buffer_count"), which)
    if device == "none":
        return {}
    out: dict[str, Any] = {"device": device}
    if device == "nvme":
        path = section.get("nvme_path")
        if not isinstance(path, str) or not path:
            raise _fail(f"{key}.nvme_path", path, "missing for device nvme", "a writable directory")
        out["nvme_path"] = path
    if "pin_memory" in section:
        out["pin_memory"] = _flag(f"{key}.pin_memory", section["pin_memory"])
    if "buffer_count" in section:
        out["buffer_count"] = _whole(f"{key}.buffer_count", section["buffer_count"], 1)
    return out


def _legacy_offload(zero: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's deprecated ``cpu_offload`` / ``cpu_offload_param`` flags, read as it reads them:
    true means ``offload_optimizer`` / ``offload_param`` on the CPU (when that section is absent)."""
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in zero:
            if _flag(f"zero_optimization.{old}", zero.pop(old)) and new not in zero:
                zero[new] = {"device": "cpu"}
    zero.pop("cpu_offload_use_pin_memory", None)  # deprecated and without effect in DeepSpeed too
    return zero


def _zero(raw: Mapping[str, Any], reader: _Reader, world_size: int) -> dict[str, Any]:
    """``zero_optimization`` -> a strategy name and its options."""
    zero = _legacy_offload(_section("zero_optimization", raw.get("zero_optimization") or {}))
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise _fail("zero_optimization.stage", stage, "not a ZeRO stage", ", ".join(map(str, ZERO_STAGES)))
    opt_off, param_off = _offload(zero, "offload_optimizer", reader), _offload(zero, "offload_param", reader)
    if param_off and stage != 3:
        raise _fail("zero_optimization.offload_param.device", param_off["device"],
                    f"parameter offload needs stage 3 (stage={stage})", 'zero_optimization.stage=3, or device "none"')
    if opt_off and stage == 0:
        raise _fail("zero_optimization.offload_optimizer.device", opt_off["device"],
                    "optimizer offload needs ZeRO (stage=0)", 'zero_optimization.stage=1, 2 or 3, or device "none"')
    if not opt_off and param_off:
        raise _fail("zero_optimization.offload_param.device", param_off["device"],
                    "zerotrain offloads parameters together with the optimizer state",
                    'also set zero_optimization.offload_optimizer.device ("cpu" or "nvme")')
    options: dict[str, Any] = {}
    if "overlap_comm" in zero and stage:
        options["overlap_comm"] = _flag("zero_optimization.overlap_comm", zero["overlap_comm"])
    buckets = ("reduce_bucket_size", "allgather_bucket_size")
    stage_keys = {1: buckets, 2: buckets,
                  3: ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                      "stage3_param_persistence_threshold")}.get(stage, ())
    least = {"stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    for key in stage_keys:
        if key in zero:
            options[key.removeprefix("stage3_")] = _whole(f"zero_optimization.{key}", zero[key], least.get(key, 1))
    # ZeRO++: qwZ for stage 3's gathers, qgZ for the reductions of stages 2 and 3
    quantized = {"zero_quantized_weights": "quantize_weights", "zero_quantized_gradients": "quantize_gradients"}
    quantized = {k: v for k, v in quantized.items() if stage == 3 or (stage == 2 and k == "zero_quantized_gradients")}
    for key, option in quantized.items():
        if key in zero:
            options[option] = _flag(f"zero_optimization.{key}", zero[key])
    if "zero_hpz_partition_size" in zero and _hpz(zero["zero_hpz_partition_size"]):
        if stage != 3:
            raise _fail("zero_optimization.zero_hpz_partition_size", zero["zero_hpz_partition_size"],
                        f"hpZ partitions stage 3's parameters (stage={stage})", "1, or zero_optimization.stage=3")
        options["hierarchical_partition"] = True
    known = ("stage", "offload_optimizer", "offload_param", "overlap_comm", *stage_keys, *quantized,
             "zero_hpz_partition_size")
    if opt_off:
        known += ("sub_group_size",)
        if "sub_group_size" in zero:
            options["sub_group_size"] = _whole("zero_optimization.sub_group_size", zero["sub_group_size"], 1)
    reader.take(zero, "zero_optimization.", known if stage else ("stage",), "zero_optimization")
    if not opt_off:
        name = {0: "ddp" if world_size > 1 else "single", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]
        return {"zero_stage": stage, "strategy": name, "strategy_options": options}
    nvme = opt_off.get("nvme_path") or param_off.get("nvme_path")
    options.update(stage=3 if stage == 3 else 2, optimizer_device=opt_off["device"],
                   param_device=param_off.get("device", "none"))
    if nvme:
        options["nvme_path"] = nvme
    for key in ("pin_memory", "buffer_count"):
        if key in opt_off or key in param_off:
            options[key] = opt_off.get(key, param_off.get(key))
    return {"zero_stage": stage, "strategy": "offload", "strategy_options": options}


def _hpz(value: Any) -> bool:
    """ZeRO++ hpZ's ``zero_hpz_partition_size``: the ranks holding the secondary copy of each
    unit's parameters. zerotrain's copy spans one node (``hierarchical_partition``), so 1 (off)
    or the ranks per node (``LOCAL_WORLD_SIZE``, when the launcher has set it) are the choices."""
    size = _whole("zero_optimization.zero_hpz_partition_size", value, 1)
    node = os.environ.get("LOCAL_WORLD_SIZE")
    if size > 1 and node is not None and size != int(node):
        raise _fail("zero_optimization.zero_hpz_partition_size", value,
                    f"zerotrain's secondary partition spans one node ({node} ranks)", f"1 (off) or {node}")
    return size > 1


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
        if not params.pop("torch_adam", False):
            params.setdefault("weight_decay", default("optimizer.params.weight_decay (Adam, AdamW)"))
        params.pop("fp32_optimizer_states", None)
        if not _flag("optimizer.params.bias_correction", params.pop("bias_correction", True)):
            raise _fail("optimizer.params.bias_correction", False, "not supported (torch's Adam always corrects)",
                        "true")
        cls = torch.optim.AdamW if lower == "adamw" or adam_w else torch.optim.Adam
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
    spec = SchedulerSpec(name, SCHEDULERS[name], params)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        spec.build(probe)
    except (TypeError, ValueError) as exc:
        raise _fail("scheduler.params", params, f"{name} rejects them ({exc})",
                    f"the parameters of DeepSpeed's {name}") from None
    return spec


def _monitoring(raw: Mapping[str, Any], reader: _Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if raw.get("steps_per_print") is not None:
        out["steps_per_print"] = _whole("steps_per_print", raw["steps_per_print"], 1)
    out["wall_clock_breakdown"] = _flag("wall_clock_breakdown", raw.get("wall_clock_breakdown", False))
    tb = _section("tensorboard", raw.get("tensorboard") or {})
    reader.take(tb, "tensorboard.", ("enabled", "output_path", "job_name"), "tensorboard")
    if _flag("tensorboard.enabled", tb.get("enabled", False)):
        path, job = tb.get("output_path") or "", tb.get("job_name", default("tensorboard.job_name"))
        for key, value in (("output_path", path), ("job_name", job)):
            if not isinstance(value, str):
                raise _fail(f"tensorboard.{key}", value, "not a string", "a directory name")
        out["tensorboard_dir"] = os.path.join(path, job)  # DeepSpeed's: "" puts it under the job name
    comms = _section("comms_logger", raw.get("comms_logger") or {})
    reader.take(comms, "comms_logger.", ("enabled", "verbose", "prof_all"), "comms_logger")
    out["comms_logger"] = _flag("comms_logger.enabled", comms.get("enabled", False))
    out["comms_verbose"] = _flag("comms_logger.verbose", comms.get("verbose", False))
    if not _flag("comms_logger.prof_all", comms.get("prof_all", default("comms_logger.prof_all"))):
        reader.ignored.append("comms_logger.prof_all=false (every collective is recorded)")
    return out

