"""How each section of a DeepSpeed config is read: the checks every value goes through (``_whole``,
``_flag``, ``_section``), the reader that lists every key nothing reads (``_Reader``: "no effect"
or "not implemented"), and the sections that shape the job: the batch sizes, the precision
(``fp16`` / ``bf16``), ``communication_data_type``, ``zero_optimization`` (a zerotrain strategy and
its options, offload included) and monitoring (``tensorboard``, ``comms_logger``). ``config.py``
assembles them with the optimizer and scheduler into a ``DeepSpeedConfig``.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

from ...errors import ConfigError
from .defaults import default
from .precision_keys import check_bf16_keys, check_fp16_master_key


ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
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
    "fp16": ("auto_cast",),
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


def _communication_dtype(raw: Mapping[str, Any], precision: str) -> str:
    """DeepSpeed's ``communication_data_type`` (``fp32`` / ``fp16`` / ``bf16``, any case); unset, its
    engine uses the 16-bit training type under fp16/bf16 and fp32 otherwise."""
    value = raw.get("communication_data_type", default("communication_data_type"))
    if value is None:
        return {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, "fp32")
    if not isinstance(value, str) or value.lower() not in ("fp32", "fp16", "bf16"):
        raise _fail("communication_data_type", value, "not a data type DeepSpeed communicates in", "fp32, fp16, bf16")
    return value.lower()


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
    master = check_bf16_keys(raw, bf16_key, _flag, bf16_on)
    check_fp16_master_key(raw, _flag)
    if not fp16_on:
        reader.take(fp16, "fp16.", ("enabled", "fp16_master_weights_and_grads"), "fp16")
        return {"precision": "bf16-mixed" if bf16_on else "32", **({"master_dtype": master} if master else {})}
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
                                "loss_scale_window", "hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"),
                "fp16")
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


def _tensor_parallel(raw: Mapping[str, Any], reader: _Reader, zero: dict[str, Any]) -> None:
    """``tensor_parallel.autotp_size``: the strategy's ``tensor_parallel`` (DDP, ZeRO-1/2/3 and their
    CPU optimizer offload cut the model by its Hugging Face ``tp_plan``); the section's other keys
    are reported as ignored."""
    section = _section("tensor_parallel", raw.get("tensor_parallel") or {})
    size = _whole("tensor_parallel.autotp_size", section.get("autotp_size", 1), 1)
    reader.take(section, "tensor_parallel.", ("autotp_size",), "tensor_parallel")
    if size == 1:
        return
    options = zero["strategy_options"]
    cpu_optimizer = zero["strategy"] == "offload" and (options["optimizer_device"], options["param_device"]) == (
        "cpu", "none")
    if zero["strategy"] not in ("ddp", "zero1", "zero2", "zero3") and not cpu_optimizer:
        raise _fail("tensor_parallel.autotp_size", size, f"zerotrain runs AutoTP under ZeRO stage 0 (more than one "
                    f"process), 1, 2 or 3, with at most the optimizer offloaded to the CPU (zero_optimization.stage="
                    f"{zero['zero_stage']}, strategy {zero['strategy']}, options {options})",
                    "1, or zero_optimization.stage 0-3 with offload_optimizer.device cpu or none and no offload_param")
    zero["strategy_options"]["tensor_parallel"] = size


def _sequence_parallel(raw: Mapping[str, Any], size: int, zero: dict[str, Any]) -> None:
    """ALST's ``initialize(mpu=...)`` (``size``: its sequence-parallel size): the strategy's
    ``sequence_parallel`` (DDP, ZeRO 1-3 over data x sequence); ``sequence_parallel_size`` in the
    config must agree with the mpu (DeepSpeed reads it only for the batch arithmetic)."""
    key = raw.get("sequence_parallel_size", size)
    if key != size:
        problem = f"the mpu's sequence-parallel size is {size}" if size > 1 else "initialize got no sequence-parallel mpu"
        raise _fail("sequence_parallel_size", key, problem,
                    f"{size}, or pass ALST's mpu (UlyssesSPAttentionHF.register_with_transformers) to initialize")
    if size == 1:
        return
    if zero["strategy"] not in ("ddp", "zero1", "zero2", "zero3") or "tensor_parallel" in zero["strategy_options"]:
        raise _fail("initialize(mpu=...)", f"sequence_parallel_size {size}", f"zerotrain runs ALST under ZeRO stage "
                    f"0-3 without offload or AutoTP (strategy {zero['strategy']}, options {zero['strategy_options']})",
                    "zero_optimization.stage 0-3, no offload_optimizer, no tensor_parallel")
    zero["strategy_options"]["sequence_parallel"] = size


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
