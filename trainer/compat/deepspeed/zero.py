"""``deepspeed.zero``: ``Init`` (build a model partitioned, for ZeRO-3) and ``GatheredParameters``
(a block in which partitioned parameters hold their full values).

``Init`` is zerotrain's ``Engine.init_module()``: the ZeRO-3 strategy the config describes
partitions each parameter as it is registered. That strategy, already holding the partitions, is
the one ``deepspeed.initialize`` then trains with; so ``initialize`` must be given a config with
the same ZeRO-3 options (it says so when not), and one ``Init`` block builds the model.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ...engine.engine import Engine
from ...errors import ConfigError
from . import comm, zero_init
from .config import DeepSpeedConfig, load_config, parse
from .zero_init import DeepSpeedInitRules

#: the Engine an Init block built a model with, waiting for ``initialize`` (at most one)
_pending: list[tuple[Engine, DeepSpeedConfig]] = []
#: engines ``initialize`` made, to find the owner of parameters given to GatheredParameters
_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def new_engine(cfg: DeepSpeedConfig) -> Engine:
    """A zerotrain Engine for ``cfg`` on the process group ``comm.init_distributed`` joined."""
    from .accelerator import get_accelerator
    from .ops.bf16_module import Bf16Module

    world = comm.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # bf16 under ZeRO 1-3: DeepSpeed's module is bf16 and its forward runs without autocast
    precision = Bf16Module() if cfg.bf16_enabled and cfg.zero_stage in (1, 2, 3) else cfg.make_precision()
    return Engine(accelerator=get_accelerator().device_name(), devices=local, num_nodes=max(1, world // local),
                  strategy=cfg.make_strategy(), precision=precision)


def take_pending(cfg: DeepSpeedConfig) -> Engine | None:
    """The Engine of an earlier ``Init`` block when its strategy is the one ``cfg`` asks for."""
    if not _pending:
        return None
    engine, built = _pending.pop()
    if (built.strategy, built.strategy_options) != (cfg.strategy, cfg.strategy_options):
        raise ConfigError(
            f"initialize: zero_optimization={cfg.raw.get('zero_optimization')!r}: the model was built under "
            f"zero.Init with other ZeRO-3 options ({built.strategy} {built.strategy_options}); valid: the same "
            "config for zero.Init(config_dict_or_path=...) and deepspeed.initialize(config=...)")
    return engine


def register(engine: Engine) -> None:
    _engines.add(engine)


class Init:
    """Context manager: parameters created inside are partitioned over the ranks as they are
    registered (no rank holds the model whole). ``config_dict_or_path`` (or ``config``) is the
    DeepSpeed config ``initialize`` will get; without one, ZeRO-3 with zerotrain's defaults.
    DeepSpeed's initialisation rules apply inside (``zero_init.py``): a parameter whose module has
    been built ignores later in-place writes outside ``Module.apply`` / ``GatheredParameters(
    modifier_rank=...)``, and new floating tensors take the config's type (fp16/bf16, else fp32;
    or ``dtype=``), even inside a transformers build that set another default type."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: "str | Mapping[str, Any] | None" = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None, **ignored: Any) -> None:
        if module is not None:
            raise ConfigError("zero.Init: module=<an existing model>; valid: None (build the model inside the "
                              "block: with zero.Init(...): model = Net())")
        if dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"zero.Init: dtype={dtype}; valid: None (the config's fp16/bf16 type, else fp32), "
                              "torch.float32, torch.float16, torch.bfloat16")
        self.enabled = enabled
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype
        self._ctx: contextlib.ExitStack | None = None

    def _config(self) -> DeepSpeedConfig:
        raw = load_config(self.config) if self.config is not None else {"zero_optimization": {"stage": 3}}
        if raw.get("train_batch_size") is None and raw.get("train_micro_batch_size_per_gpu") is None:
            raw["train_micro_batch_size_per_gpu"] = 1  # Init does not need the batch sizes
        cfg = parse(raw, comm.get_world_size())
        if cfg.zero_stage != 3:
            raise ConfigError(f"zero.Init: zero_optimization.stage={cfg.zero_stage}: Init partitions parameters, "
                              "which only stage 3 trains; valid: 3")
        return cfg

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if _pending:
            raise ConfigError("zero.Init: a model was already built under zero.Init and not yet given to "
                              "deepspeed.initialize; valid: one zero.Init block per model, then initialize")
        comm.init_distributed()
        cfg = self._config()
        engine = new_engine(cfg)
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(engine.init_module())
        dtype = self.dtype or (torch.float16 if cfg.fp16_enabled else torch.bfloat16 if cfg.bf16_enabled
                               else torch.float32)
        rules = self._ctx.enter_context(DeepSpeedInitRules(dtype))
        zero_init.active.append(rules)
        self._ctx.callback(zero_init.active.remove, rules)
        _pending.append((engine, cfg))
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(*exc)
            if exc[0] is not None:
                _pending.clear()
        return False


def _owner(params: list[nn.Parameter]) -> Any:
    """The ZeRO-3 strategy whose units hold ``params`` (None: they are not partitioned)."""
    from ....strategies.zero.stage3.unit import is_placeholder

    wanted = {id(p) for p in params}
    for engine in list(_engines):
        units = getattr(engine.strategy, "units", None)
        if units and any(id(p) in wanted for u in units for p in u.params):
            return engine.strategy
    if any(is_placeholder(p) for p in params):
        raise ConfigError("GatheredParameters: these parameters were built under zero.Init and are not set up "
                          "yet; valid: inside the zero.Init block (they gather on use there) or after "
                          "deepspeed.initialize")
    return None


class GatheredParameters:
    """Context manager: inside, ``params`` (one parameter or several) hold their full values on
    every rank. With ``modifier_rank``, that rank's values when the block ends become the
    parameters' values everywhere (written into the ZeRO-3 partitions). Parameters that are not
    partitioned (ZeRO 0-2, or inside a ``zero.Init`` block, where they gather on use) are left as
    they are, as DeepSpeed does."""

    def __init__(self, params: "nn.Parameter | Iterable[nn.Parameter]", modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._strategy: Any = None
        self._units: list = []
        self._writable = contextlib.ExitStack()

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled or not self.params:
            return self
        if zero_init.active and self.modifier_rank is not None:  # inside zero.Init: writes reach the partitions
            self._writable = contextlib.ExitStack()
            self._writable.enter_context(zero_init.active[-1].writable(self.params))
        s = self._strategy = _owner(self.params)
        if s is None:
            return self
        if self.modifier_rank is not None and s.name != "zero3":
            raise ConfigError(f"GatheredParameters: modifier_rank={self.modifier_rank} under strategy={s.name!r}: "
                              "writing into offloaded partitions is not supported; valid: modifier_rank=None "
                              "(read only), or ZeRO-3 without offload")
        wanted = {id(p) for p in self.params}
        self._units = [u for u in s.units if any(id(p) in wanted for p in u.params)]
        s.runtime.hold(self._units)
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._writable.close()
        s, self._strategy = self._strategy, None
        if s is None:
            return False
        try:
            if exc[0] is None and self.modifier_rank is not None:
                self._write_back(s)
        finally:
            s.runtime.free_all()
        return False

    def _write_back(self, s: Any) -> None:
        """``modifier_rank``'s full values to every rank, each keeping its partition of them (the
        fp32 master and the working shard). As DeepSpeed, ``modifier_rank`` is a rank of the group
        the parameters are partitioned over (the replicas, with AutoTP's tensor axis)."""
        with torch.no_grad():
            for u in self._units:
                if dist.is_initialized():
                    src = self.modifier_rank if s.group is None else dist.get_global_rank(s.group, self.modifier_rank)
                    dist.broadcast(u.full, src, group=s.group)
                u.load_full(u.full.detach().clone())
