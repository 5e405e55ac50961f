"""``zerotrain.deepspeed``: DeepSpeed's training API on zerotrain, so that a DeepSpeed script runs
with only its imports changed (``import deepspeed`` -> ``import zerotrain.deepspeed as deepspeed``,
``from deepspeed import comm`` -> ``from zerotrain.deepspeed import comm``, ...).

``initialize`` reads DeepSpeed's JSON config (``config.py``) into a zerotrain strategy, precision
plugin, optimizer and LR scheduler, sets them up through :class:`zerotrain.Engine` (no second
implementation of any strategy) and returns DeepSpeed's ``(engine, optimizer, dataloader,
lr_scheduler)``; the engine (``engine.py``) keeps DeepSpeed's per-micro-batch protocol. The README's
"Coming from DeepSpeed" section lists what is supported and every deliberate difference.

This package never imports DeepSpeed.

May import: trainer.checkpoint, trainer.engine, trainer.errors, trainer.launch, ops, strategies."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import pkgutil
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ...errors import ConfigError
from . import accelerator, checkpointing, comm, lr_schedules, moe, ops, pipe, runtime, sequence, utils, zero  # noqa: F401  (deepspeed.<module>)
from .autotp import check_inputs_once, cut_for_autotp, sequence_parallel_of
from .comm import init_distributed
from .config import DeepSpeedAssertion, DeepSpeedConfig, parse, report_ignored
from .engine import DeepSpeedEngine
from .git_version_info import git_branch as __git_branch__, git_hash as __git_hash__, version as __version__
from .ops.bf16_module import Bf16Module, cast_remaining_params
from .ops.sixteen_bit import sixteen_bit_steps

log = logging.getLogger("zerotrain")

#: the DeepSpeed release whose behaviour this face follows (scripts compare it to gate features):
#: ``__version__``, ``__git_hash__``, ``__git_branch__`` from git_version_info
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))


def _submodules() -> dict[str, Any]:
    """Every module of this package by its dotted name below it ("comm", "moe.utils", ...), for
    ``zerotrain/__init__.py`` to register under ``zerotrain.deepspeed.<name>``: all of them, so that
    no path imports a second copy of one."""
    return {info.name[len(__name__) + 1:]: importlib.import_module(info.name)
            for info in pkgutil.walk_packages(__path__, f"{__name__}.")}


SUBMODULES = _submodules()


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """DeepSpeed's order: ``config`` (or the older ``config_params``), else ``args.deepspeed_config``;
    both given is an error, as neither is clearly meant."""
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ConfigError(f"initialize: args.deepspeed_config={from_args!r} and config= both given; valid: one of them")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("initialize: config=None and no args.deepspeed_config; valid: a config dict, the path of "
                          "a JSON file, or --deepspeed_config on the command line")
    return config


def _local_rank_from_args(args: Any) -> None:
    """``--local_rank=N`` as DeepSpeed's launcher passes it (and torch.distributed.launch did).
    DeepSpeed reads the local rank from LOCAL_RANK and requires ``args.local_rank`` to agree; a
    launcher that passes only the argument leaves the variable unset, and then the argument sets
    it, so that the engine's device and ``deepspeed.comm.get_local_rank()`` follow it. -1 (the
    usual default of the argument) means not given."""
    value = getattr(args, "local_rank", None)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"initialize: args.local_rank={value!r}; valid: an integer (the --local_rank=N a "
                          "launcher passes, or -1)")
    env = os.environ.get("LOCAL_RANK")
    if value < 0:
        return
    if env is None:
        os.environ["LOCAL_RANK"] = str(value)
    elif int(env) != value:
        raise ConfigError(f"initialize: args.local_rank={value} but LOCAL_RANK={env}; valid: the same local "
                          "rank in both (or only one of them)")


def _optimizer(cfg: DeepSpeedConfig, client: Any, model: nn.Module, model_parameters: Any) -> torch.optim.Optimizer:
    """The client's optimizer (an instance, or a callable given the parameters), else the config's."""
    params = model_parameters if model_parameters is not None else model.parameters()
    if isinstance(client, torch.optim.Optimizer):
        opt, origin = client, "optimizer"
    elif callable(client):
        opt, origin = client(params), "optimizer(model_parameters)"
    elif client is not None:
        raise ConfigError(f"initialize: optimizer={type(client).__name__}; valid: a torch.optim.Optimizer, a "
                          "callable returning one, or None (the config's optimizer)")
    elif cfg.optimizer is not None:
        return cfg.optimizer.build(params)
    else:
        raise ConfigError("initialize: optimizer=None and the config has no \"optimizer\"; valid: an optimizer "
                          "(zerotrain.deepspeed trains; it has no inference-only engine)")
    cfg.check_optimizer(opt, origin)
    return opt


def _scheduler(cfg: DeepSpeedConfig, client: Any, optimizer: torch.optim.Optimizer, client_optimizer: Any) -> Any:
    if client is not None and hasattr(client, "step") and not isinstance(client_optimizer, torch.optim.Optimizer):
        raise DeepSpeedAssertion(  # DeepSpeed's rule: a built scheduler steps an optimizer the script built
            f"initialize: lr_scheduler={type(client).__name__} (built) with optimizer="
            f"{type(client_optimizer).__name__}; valid: a built optimizer with it, or a callable that takes the "
            "optimizer and returns the scheduler")
    if client is None:
        return cfg.scheduler.build(optimizer) if cfg.scheduler is not None else None
    if callable(client) and not hasattr(client, "step"):
        return client(optimizer)
    return client


def _broadcast_weights(model: nn.Module, device: torch.device) -> None:
    """Rank 0's initial weights everywhere, as DeepSpeed broadcasts them at initialize (a model
    built under zero.Init is partitioned already: nothing to broadcast); an MoE layer's experts
    from the first rank of their expert-data-parallel group, over that group. Through ``device``: NCCL
    sends only what is on the GPU."""
    from ....strategies.zero.stage3.unit import is_placeholder

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    replicas = moe.layer.expert_data_groups(model)  # expert parameters: over their own replicas only
    with torch.no_grad():
        for p in model.parameters():
            if not is_placeholder(p):
                group, src = replicas.get(id(p), (None, 0))
                t = p.data.to(device)
                dist.broadcast(t, src, group=group)
                if t is not p.data:
                    p.data.copy_(t)


def _bf16_module_under_fp32(cfg: DeepSpeedConfig, model: nn.Module) -> DeepSpeedConfig:
    """A bf16 module under an fp32 config at ZeRO 1/2: DeepSpeed keeps the module as it is (no
    cast), its ZeRO optimizer steps fp32 copies of the bf16 partitions and reduces the gradients in
    fp32 (``communication_data_type``'s default without fp16/bf16), which is zerotrain's bf16-mixed
    with an fp32 reduction. (Found on examples/sdma_allgather built eagerly: transformers'
    ``torch_dtype=bfloat16`` made a bf16 model, and zerotrain trained it in fp32.)"""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if cfg.precision != "32" or cfg.zero_stage not in (1, 2) or not params or \
            any(p.dtype != torch.bfloat16 for p in params):
        return cfg
    options = {**cfg.strategy_options, "reduce_dtype": cfg.strategy_options.get("reduce_dtype", "fp32")}
    return dataclasses.replace(cfg, precision="bf16-mixed", strategy_options=options)


def _round_to_16bit(model: nn.Module, cfg: DeepSpeedConfig) -> None:
    """fp16/bf16: DeepSpeed casts the module to the 16-bit type before its optimizer copies the
    fp32 masters, so the masters start from the 16-bit-rounded weights. zerotrain keeps the
    module's fp32 parameters (its forward runs under autocast) and builds the masters from them:
    round them through the 16-bit type in place, so both start from the same values. Without it
    a small first update (a warm-up's lr) moved zerotrain's weights by a rounding step where
    DeepSpeed's stayed put. Parameters built under zero.Init (placeholders) are left as they are."""
    from ....strategies.zero.stage3.unit import is_placeholder

    dtype = torch.float16 if cfg.fp16_enabled else torch.bfloat16 if cfg.bf16_enabled else None
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype and not is_placeholder(p):
                p.copy_(p.to(dtype))


def _dataloader(cfg: DeepSpeedConfig, engine: Any, dataset: Any, collate_fn: Callable | None) -> DataLoader:
    """DeepSpeed's training loader: ``train_micro_batch_size_per_gpu`` samples per batch, drawn by
    a DistributedSampler with its defaults (shuffled with seed 0; the same order every pass, since
    DeepSpeed never sets its epoch)."""
    if not isinstance(dataset, torch.utils.data.Dataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(f"initialize: training_data={type(dataset).__name__}; valid: a map-style "
                          "torch.utils.data.Dataset (with __len__)")
    s = engine.strategy
    sampler = DistributedSampler(dataset, num_replicas=s.data_parallel_world_size, rank=s.data_parallel_rank)
    return DataLoader(dataset, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn,
                      drop_last=cfg.dataloader_drop_last, pin_memory=engine.device.type == "cuda")


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: "str | Mapping[str, Any] | None" = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``: returns ``(engine, optimizer, training_dataloader, lr_scheduler)``
    (the dataloader None without ``training_data``, the scheduler None without one). Collective."""
    if not isinstance(model, nn.Module):
        raise DeepSpeedAssertion(f"initialize: model={type(model).__name__}; valid: an nn.Module (model=..., "
                                 "by keyword: the first positional argument is args)")
    if mesh_param is not None:
        raise ConfigError(f"initialize: mesh_param={mesh_param!r}; valid: None (zerotrain.deepspeed takes no device "
                          "mesh: AutoTP through the config's tensor_parallel, Ulysses through ALST's mpu)")
    source = _config_source(args, config, config_params)
    _local_rank_from_args(args)
    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    sp = sequence_parallel_of(mpu)  # ALST's mpu: the strategy's sequence axis
    if isinstance(model, pipe.PipelineModule):  # DeepSpeed's PipelineEngine, on the pipeline strategy
        if sp > 1:
            raise ConfigError("initialize: a PipelineModule with ALST's mpu; valid: mpu=None for a pipeline")
        return pipe.engine.initialize(source, model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn)
    cfg = _bf16_module_under_fp32(parse(source, comm.get_world_size(), sp), model)
    engine = zero.take_pending(cfg) or zero.new_engine(cfg)
    engine.launch()
    if engine.global_rank == 0:
        report_ignored(cfg)
        if optimizer is not None and cfg.optimizer is not None:
            log.warning("initialize: the config's \"optimizer\" is not used: an optimizer was passed "
                        "(DeepSpeed's rule)")
        if cfg.activation_checkpointing is not None and not checkpointing.is_configured():
            log.info("initialize: the config's \"activation_checkpointing\" applies once the script calls "
                     "deepspeed.checkpointing.configure(None, deepspeed_config=...), as in DeepSpeed")
    _broadcast_weights(model, engine.device)  # the whole model (rank 0's), then
    cut_for_autotp(engine.strategy, model)  # tensor_parallel.autotp_size: each rank's shards, before the optimizer
    check_inputs_once(engine.strategy, model)
    _round_to_16bit(model, cfg)
    opt = _optimizer(cfg, optimizer, model, model_parameters)
    sixteen = sixteen_bit_steps(cfg, opt, model)  # bf16 at stage 0: DeepSpeed's 16-bit optimizer wrapper
    if cfg.strategy == "zero1" and cfg.precision == "32":  # DeepSpeed's fp32 ZeRO-1: the last backward wins
        engine.strategy.last_backward_wins = True  # (strategies/zero/stage1.py)
    wrapped_model, wrapped_opt = engine.setup(model, opt)
    if isinstance(engine.strategy.precision, Bf16Module):
        cast_remaining_params(model)  # DeepSpeed's module is bf16 whole: the parameters outside the optimizer too
    zero.register(engine)
    if sixteen is not None:
        sixteen.setup()  # its zero-gradient step, at the configured lr (before the scheduler)
    sched = _scheduler(cfg, lr_scheduler, opt, optimizer)
    loader = _dataloader(cfg, engine, training_data, collate_fn) if training_data is not None else None
    ds_engine = DeepSpeedEngine(engine, cfg, wrapped_model, wrapped_opt, sched, loader)
    ds_engine.sixteen_bit = sixteen
    if hasattr(args, "local_rank"):
        args.local_rank = ds_engine.local_rank  # DeepSpeed aligns the argument with the engine's
    return ds_engine, wrapped_opt, loader, sched


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed`` (a flag scripts test) and
    ``--deepspeed_config`` (the JSON path ``initialize(args=...)`` reads). Like DeepSpeed's, it
    does not add ``--local_rank``: scripts define that themselves, and ``initialize`` reads it."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
           "ConfigError", "DeepSpeedAssertion", "comm", "accelerator", "zero", "moe", "lr_schedules", "checkpointing", "ops", "pipe", "runtime",
           "utils"]
