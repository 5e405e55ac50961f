"""Every DeepSpeed config key ``zerotrain.deepspeed`` reads, with the value it takes when the key is
absent and where DeepSpeed 0.19.8 keeps its own default for it.

``config.py`` reads its defaults from here (:func:`default`), the README's table is
:func:`markdown_table`, and ``tests/unit/test_deepspeed_defaults.py`` resolves every ``where``
against the installed DeepSpeed and checks ``deepspeed`` is its value and, unless ``differs``
gives a reason, that ours equals it.

The rule: a key whose value changes what a run computes (clipping, the optimizer's
hyper-parameters, loss scaling, batch sizes, drop_last, precision) takes DeepSpeed's default. A key
that only tunes speed or memory (message sizes, overlap, prefetch, reuse, persistence, sub-groups,
I/O buffers) keeps zerotrain's measured default (``strategies/zero/config.py``,
``strategies/offload/config.py``), and ``differs`` says so; the numbers a run produces are the same.

``where`` forms: ``module:NAME`` (a constant), ``module:Class.field`` (a pydantic field's default),
``module:Class(arg)`` (a keyword default of ``Class.__init__``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ....strategies.offload.config import OffloadPolicy
from ....strategies.zero.config import BucketConfig, Stage3Config, ZeroConfig

_C = "deepspeed.runtime.constants"
_ZERO = "deepspeed.runtime.zero.config:DeepSpeedZeroConfig"
_PREC = "deepspeed.runtime.precision_config"
_AC = "deepspeed.runtime.activation_checkpointing.config"
_OPT_OFF = "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig"
_PARAM_OFF = "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig"
_ADAM = "deepspeed.ops.adam.fused_adam:FusedAdam"
_SPEED = "speed/memory only (same results): zerotrain's measured default"


def _field(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default


@dataclass(frozen=True)
class Default:
    #: the key as DeepSpeed spells it (dotted for sections)
    key: str
    #: what zerotrain uses when the key is absent
    ours: Any
    #: DeepSpeed 0.19.8's default (checked against the installed DeepSpeed by the test)
    deepspeed: Any
    #: where DeepSpeed keeps it
    where: str
    #: why ours differs (empty: it does not)
    differs: str = ""


DEFAULTS: tuple[Default, ...] = (
    Default("train_batch_size", None, None, f"{_C}:TRAIN_BATCH_SIZE_DEFAULT"),
    Default("train_micro_batch_size_per_gpu", None, None, f"{_C}:TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT"),
    Default("gradient_accumulation_steps", None, None, f"{_C}:GRADIENT_ACCUMULATION_STEPS_DEFAULT"),
    Default("gradient_clipping", 1.0, 1.0, f"{_C}:GRADIENT_CLIPPING_DEFAULT"),
    Default("zero_allow_untested_optimizer", False, False, f"{_C}:ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT"),
    Default("steps_per_print", None, None, f"{_C}:STEPS_PER_PRINT_DEFAULT"),
    Default("wall_clock_breakdown", False, False, f"{_C}:WALL_CLOCK_BREAKDOWN_DEFAULT"),
    Default("dataloader_drop_last", False, False, f"{_C}:DATALOADER_DROP_LAST_DEFAULT"),
    Default("communication_data_type", None, None, f"{_C}:COMMUNICATION_DATA_TYPE_DEFAULT"),
    Default("fp16.enabled", False, False, f"{_PREC}:DeepSpeedFP16Config.enabled"),
    Default("fp16.loss_scale", 0, 0, f"{_PREC}:DeepSpeedFP16Config.loss_scale"),
    Default("fp16.initial_scale_power", 16, 16, f"{_PREC}:DeepSpeedFP16Config.initial_scale_power"),
    Default("fp16.loss_scale_window", 1000, 1000, f"{_PREC}:DeepSpeedFP16Config.loss_scale_window"),
    Default("fp16.hysteresis", 2, 2, f"{_PREC}:DeepSpeedFP16Config.hysteresis"),
    Default("fp16.consecutive_hysteresis", False, False, f"{_PREC}:DeepSpeedFP16Config.consecutive_hysteresis"),
    Default("fp16.min_loss_scale", 1, 1, f"{_PREC}:DeepSpeedFP16Config.min_loss_scale"),
    Default("bf16.enabled", False, False, f"{_PREC}:DeepSpeedBF16Config.enabled"),
    Default("bf16.bf16_master_weights_and_grads", False, False,
            f"{_PREC}:DeepSpeedBF16Config.bf16_master_weights_and_grads"),
    Default("bf16.bf16_optimizer_states", False, False, f"{_PREC}:DeepSpeedBF16Config.bf16_optimizer_states"),
    Default("torch_autocast.enabled", False, False, f"{_C}:TORCH_AUTOCAST_ENABLED_DEFAULT"),
    Default("optimizer.params.lr (Adam, AdamW)", 1e-3, 1e-3, f"{_ADAM}(lr)"),
    Default("optimizer.params.betas (Adam, AdamW)", (0.9, 0.999), (0.9, 0.999), f"{_ADAM}(betas)"),
    Default("optimizer.params.eps (Adam, AdamW)", 1e-8, 1e-8, f"{_ADAM}(eps)"),
    Default("optimizer.params.weight_decay (Adam, AdamW)", 0.0, 0.0, f"{_ADAM}(weight_decay)"),
    Default("optimizer.params.bias_correction (Adam, AdamW)", True, True, f"{_ADAM}(bias_correction)"),
    Default("optimizer.params.adam_w_mode (Adam)", True, True, "deepspeed.runtime.config:ADAM_W_MODE_DEFAULT"),
    Default("zero_optimization.stage", 0, 0, f"{_ZERO}.stage"),
    Default("zero_optimization.overlap_comm", _field(ZeroConfig, "overlap_comm"), None, f"{_ZERO}.overlap_comm",
            f"None means false, true at stage 3; {_SPEED}"),
    Default("zero_optimization.reduce_bucket_size", _field(BucketConfig, "reduce_bucket_size"), 500_000_000,
            f"{_ZERO}.reduce_bucket_size", _SPEED),
    Default("zero_optimization.allgather_bucket_size", _field(BucketConfig, "allgather_bucket_size"), 500_000_000,
            f"{_ZERO}.allgather_bucket_size", _SPEED),
    Default("zero_optimization.stage3_prefetch_bucket_size", _field(Stage3Config, "prefetch_bucket_size"),
            50_000_000, f"{_ZERO}.prefetch_bucket_size", _SPEED),
    Default("zero_optimization.stage3_max_live_parameters", _field(Stage3Config, "max_live_parameters"),
            1_000_000_000, f"{_ZERO}.max_live_parameters"),
    Default("zero_optimization.stage3_max_reuse_distance", _field(Stage3Config, "max_reuse_distance"),
            1_000_000_000, f"{_ZERO}.max_reuse_distance", f"'auto': a budget from free memory; {_SPEED}"),
    Default("zero_optimization.stage3_param_persistence_threshold",
            _field(Stage3Config, "param_persistence_threshold"), 100_000,
            f"{_ZERO}.param_persistence_threshold", _SPEED),
    Default("zero_optimization.zero_quantized_weights", False, False, f"{_ZERO}.zero_quantized_weights"),
    Default("zero_optimization.zero_quantized_gradients", False, False, f"{_ZERO}.zero_quantized_gradients"),
    Default("zero_optimization.zero_hpz_partition_size", 1, 1, f"{_ZERO}.zero_hpz_partition_size"),
    Default("zero_optimization.sub_group_size (under offload)", _field(OffloadPolicy, "sub_group_size"),
            1_000_000_000, f"{_ZERO}.sub_group_size", _SPEED),
    Default("zero_optimization.offload_optimizer.device", "none", "none", f"{_OPT_OFF}.device"),
    Default("zero_optimization.offload_optimizer.pin_memory", _field(OffloadPolicy, "pin_memory"), True,
            f"{_OPT_OFF}.pin_memory"),
    Default("zero_optimization.offload_optimizer.buffer_count", _field(OffloadPolicy, "buffer_count"), 4,
            f"{_OPT_OFF}.buffer_count"),
    Default("zero_optimization.offload_param.device", "none", "none", f"{_PARAM_OFF}.device"),
    Default("zero_optimization.offload_param.pin_memory", _field(OffloadPolicy, "pin_memory"), True,
            f"{_PARAM_OFF}.pin_memory"),
    Default("zero_optimization.offload_param.buffer_count", _field(OffloadPolicy, "buffer_count"), 5,
            f"{_PARAM_OFF}.buffer_count", f"one buffer_count for both offloads; {_SPEED}"),
    Default("activation_checkpointing.partition_activations", False, False,
            f"{_AC}:ACT_CHKPT_PARTITION_ACTIVATIONS_DEFAULT"),
    Default("activation_checkpointing.contiguous_memory_optimization", False, False,
            f"{_AC}:ACT_CHKPT_CONTIGUOUS_MEMORY_OPTIMIZATION_DEFAULT"),
    Default("activation_checkpointing.cpu_checkpointing", False, False, f"{_AC}:ACT_CHKPT_CPU_CHECKPOINTING_DEFAULT"),
    Default("activation_checkpointing.number_checkpoints", None, None, f"{_AC}:ACT_CHKPT_NUMBER_CHECKPOINTS_DEFAULT"),
    Default("activation_checkpointing.synchronize_checkpoint_boundary", False, False,
            f"{_AC}:ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY_DEFAULT"),
    Default("activation_checkpointing.profile", False, False, f"{_AC}:ACT_CHKPT_PROFILE_DEFAULT"),
    Default("tensorboard.enabled", False, False, "deepspeed.monitor.config:TensorBoardConfig.enabled"),
    Default("tensorboard.output_path", "", "", "deepspeed.monitor.config:TensorBoardConfig.output_path"),
    Default("tensorboard.job_name", "DeepSpeedJobName", "DeepSpeedJobName",
            "deepspeed.monitor.config:TensorBoardConfig.job_name"),
    Default("comms_logger.enabled", False, False, "deepspeed.comm.config:CommsLoggerConfig.enabled"),
    Default("comms_logger.verbose", False, False, "deepspeed.comm.config:CommsLoggerConfig.verbose"),
    Default("comms_logger.prof_all", True, True, "deepspeed.comm.config:CommsLoggerConfig.prof_all"),
)

_BY_KEY = {d.key: d for d in DEFAULTS}


def default(key: str) -> Any:
    """zerotrain's value for ``key`` when the config leaves it out."""
    return _BY_KEY[key].ours


#: the schedulers' keyword defaults are compared by signature (``SCHEDULERS`` against
#: ``deepspeed.runtime.lr_schedules``), not listed: ours are DeepSpeed's, parameter by parameter
SCHEDULER_SOURCE = "deepspeed.runtime.lr_schedules"


def markdown_table() -> str:
    """The README's table: key, zerotrain's default, DeepSpeed 0.19.8's, why they differ."""
    rows = ["| key | zerotrain | DeepSpeed 0.19.8 | note |", "|---|---|---|---|"]
    for d in DEFAULTS:
        rows.append(f"| `{d.key}` | `{d.ours!r}` | `{d.deepspeed!r}` | {d.differs or 'same'} |")
    return "\n".join(rows)
