"""``zerotrain.Fabric``: the Engine under Lightning Fabric's names, so that a Fabric script runs
with one import renamed (``from lightning.fabric import Fabric, seed_everything`` ->
``from zerotrain import Fabric, seed_everything``; README, "Coming from Lightning Fabric").

What it adds to the Engine (``engine.py``): Fabric's constructor (``accelerator``, ``strategy``,
``devices``, ``num_nodes``, ``precision``, ``callbacks``, ``loggers``; when left at their
defaults, the ``LT_*`` variables ``fabric run`` sets are read, as Fabric reads them),
``rank_zero_first``, ``log`` / ``log_dict`` to the loggers, ``call`` for callbacks, ``to_device``,
``seed_everything``, and ``setup_module`` / ``setup_optimizers`` as two calls of ``setup``. The
loaders, optimizers and checkpoints are the Engine's (transparent loaders, optimizers torch's LR
schedulers accept, the sharded checkpoint format).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .engine import Engine
from ..errors import ConfigError
from ..loop.evaluation import to_device as _to_device
from ..api.module import TrainModule
from ..utilities import seed_everything as _seed_everything

#: Fabric's precision names with no zerotrain counterpart of the same spelling
_PRECISIONS = {None: "32", "32-true": "32", 32: "32", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}


def _cli_used() -> bool:
    """The script was started by ``fabric run`` (which sets ``LT_CLI_USED=1``)."""
    return os.environ.get("LT_CLI_USED", "0") not in ("", "0")


def _env(name: str, value: Any, default: Any) -> Any:
    """Fabric's rule: ``fabric run``'s ``LT_<NAME>``, when set, wins over the argument (also over
    one given in the code: ``Fabric(devices=1)`` under ``LT_DEVICES=2`` runs 2); under ``fabric
    run`` itself (``LT_CLI_USED=1``) an argument given in the code that differs from it is an error."""
    env = os.environ.get(f"LT_{name}")
    if env is None:
        return value
    if env != str(value) and str(value) != str(default) and _cli_used():
        key = name.lower()
        raise ConfigError(f"Fabric: {key}={value!r} in the code conflicts with --{key}={env} given to fabric run "
                          f"(LT_{name}); valid: set it in one place only")
    return int(env) if name in ("DEVICES", "NUM_NODES") and env.isdigit() else env


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]


class Fabric(Engine):
    """Lightning Fabric's surface on the Engine; see the module docstring."""

    def __init__(self, accelerator: str = "auto", strategy: Any = "auto", devices: Any = "auto", num_nodes: int = 1,
                 precision: Any = None, plugins: Any = None, callbacks: Any = None, loggers: Any = None) -> None:
        if plugins is not None:
            raise ConfigError(f"Fabric: plugins={plugins!r}; valid: None (choose precision and strategy by "
                              "name: precision='bf16-mixed', strategy='zero3', ...)")
        accelerator = _env("ACCELERATOR", accelerator, "auto")
        strategy = _env("STRATEGY", strategy, "auto")
        devices = _env("DEVICES", devices, "auto")
        num_nodes = int(_env("NUM_NODES", num_nodes, 1))
        precision = _env("PRECISION", precision, None)
        # Fabric's "gpu" is CUDA here; without a CUDA device it is refused (as Fabric refuses it), not
        # silently run on the CPU
        super().__init__(accelerator="cuda" if accelerator == "gpu" else accelerator,
                         devices=devices, num_nodes=num_nodes, strategy=strategy,
                         precision=_PRECISIONS.get(precision, precision))
        self._callbacks = _as_list(callbacks)
        self._loggers = _as_list(loggers)
        self._pending_module: nn.Module | None = None
        if _cli_used():  # started by `fabric run`: join the job now, as Fabric does, so that the ranks
            self.launch()  # re-seed (seed_everything's seed) here, before the script builds its model

    # ------------------------------------------------------------------ Fabric's names
    def launch(self, function: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Join the job (the Engine's ``launch``); with ``function``, then run
        ``function(fabric, *args, **kwargs)`` on every rank and return this rank's result."""
        super().launch()
        return function(self, *args, **kwargs) if function is not None else None

    @property
    def loggers(self) -> list[Any]:
        return list(self._loggers)

    @property
    def logger(self) -> Any:
        return self._loggers[0] if self._loggers else None

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool = False) -> int:
        return _seed_everything(seed, workers)

    def to_device(self, obj: Any) -> Any:
        """Tensors (in any nesting of lists, tuples, dicts) and modules moved to ``device``."""
        self.launch()
        if isinstance(obj, nn.Module):
            return obj.to(self.device)
        return _to_device(obj, self.device)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Collective: rank 0 (of the node, with ``local``) runs the block first (downloads, caches),
        then the others run it."""
        self.launch()
        first = (self.local_rank if local else self.global_rank) == 0
        if not first:
            self.barrier()
        yield
        if first:
            self.barrier()

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Each logger's ``log_metrics`` with the values as numbers (tensors ``.item()``-ed), on
        global rank 0."""
        self.launch()
        if not self.is_global_zero:
            return
        values = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(metrics=values, step=step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Every callback's ``hook_name`` (those without one are skipped)."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if callable(method):
                method(*args, **kwargs)

    def clip_gradients(self, module: Any, optimizer: Any, clip_val: float | None = None,
                       max_norm: float | None = None, norm_type: float = 2.0,
                       error_if_nonfinite: bool = True) -> torch.Tensor | None:
        """Fabric's signature and rules: exactly one of ``clip_val`` (every gradient element
        clamped to ``[-clip_val, clip_val]``, as ``torch.nn.utils.clip_grad_value_``; under ZeRO
        each rank clamps its partition, which is exact as the clamp is element-wise) and
        ``max_norm`` (global 2-norm; ``error_if_nonfinite``: a NaN/inf norm raises in the step,
        before anything changes). The clipping happens in the next ``optimizer.step()``, after
        the unscale and overflow check (the Engine's ``clip_gradients``), so for ``max_norm`` the
        returned scalar tensor is NaN until that step writes the norm before clipping into it;
        ``clip_val`` returns None, as Fabric. Norms other than 2 are refused."""
        if clip_val is not None and max_norm is not None:
            raise ConfigError(f"Fabric.clip_gradients: clip_val={clip_val!r} and max_norm={max_norm!r}; valid: "
                              "only one of them (each names the clipping algorithm)")
        if clip_val is None and max_norm is None:
            raise ConfigError("Fabric.clip_gradients: neither clip_val nor max_norm given; valid: one of them")
        if clip_val is not None:
            self._clip_next_step(module, optimizer, "clip_val", clip_val)
            return None
        if isinstance(norm_type, bool) or norm_type != 2.0:
            raise ConfigError(f"Fabric.clip_gradients: norm_type={norm_type!r}; valid: 2.0 (the strategies "
                              "compute the global 2-norm over partitioned gradients)")
        self._clip_next_step(module, optimizer, "max_norm", max_norm, error_if_nonfinite)
        optimizer.clip_norm_out = torch.full((), float("nan"))
        return optimizer.clip_norm_out

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Fabric's: a tensor or number, or any nesting of lists, tuples and dicts of them, each
        gathered to shape ``(world_size, *shape)``; on one process returned as tensors of their
        own shape (no dimension added, as Fabric). ``group``/``sync_grads`` are refused."""
        if group is not None or sync_grads:
            raise ConfigError(f"Fabric.all_gather: group={group!r}, sync_grads={sync_grads!r}; valid: the defaults "
                              "(all processes, no gradient through the gather)")
        self.launch()
        if isinstance(data, (list, tuple)):
            return type(data)(self.all_gather(d) for d in data)
        if isinstance(data, dict):
            return {k: self.all_gather(v) for k, v in data.items()}
        if not torch.is_tensor(data):  # Fabric's conversions: bool -> uint8, int -> int32, float -> float32
            dtype = {bool: torch.uint8, int: torch.int32, float: torch.float32}.get(type(data))
            data = torch.tensor(data, dtype=dtype) if dtype is not None else torch.as_tensor(data)
        return data.to(self.device) if self.world_size == 1 else super().all_gather(data)

    def _resolve(self, model: Any) -> Any:
        return model._target() if isinstance(model, _PendingModule) else model

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> tuple[Any, ...]:
        """The Engine's ``setup``; a TrainModule (Lightning's LightningModule) then knows this Fabric,
        as under Fabric: its ``self.logger`` / ``self.loggers`` are the Fabric's."""
        out = super().setup(model, *optimizers)
        model = getattr(model, "_orig_mod", model)  # setup(torch.compile(model))
        if isinstance(model, TrainModule):
            model.__dict__["_fabric"] = self
        return out

    # ------------------------------------------------------------------ set-up in two calls
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Fabric's first half of ``setup``: the model is held until ``setup_optimizers`` (the
        strategy takes both together); returns the module itself until then."""
        if not isinstance(module, nn.Module):
            raise ConfigError(f"Fabric.setup_module: module={type(module).__name__}; valid: an nn.Module")
        self._pending_module = module
        return _PendingModule(self, module)

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """The second half: with the module from ``setup_module``, ``setup`` runs; returns the
        optimizer wrapper (a tuple for several). The module returned by ``setup_module`` runs
        through the strategy from now on."""
        if self._pending_module is None:
            raise ConfigError("Fabric.setup_optimizers: no module set up; valid: fabric.setup_module(model) "
                              "first, or fabric.setup(model, optimizer)")
        module, self._pending_module = self._pending_module, None
        _, *wrapped = self.setup(module, *optimizers)
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)


class _PendingModule:
    """What ``setup_module`` returns: the user's module until ``setup_optimizers`` has run, then
    the Engine's model wrapper (calls go through the strategy)."""

    def __init__(self, fabric: Fabric, module: nn.Module) -> None:
        object.__setattr__(self, "_fabric", fabric)
        object.__setattr__(self, "_module", module)

    def _target(self) -> Any:
        model = self._fabric._model
        return model if model is not None and model.module is self._module else self._module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._module, name, value)
