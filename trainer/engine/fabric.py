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
import inspect
import os
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from torch.utils.data import DataLoader

from ...strategies.optimizers import OptimizerSet
from .engine import Engine
from .wrappers import EngineLoader, EngineModule, EngineOptimizer
from ..errors import ConfigError
from ..loop.evaluation import to_device as _to_device
from ..api.from_checkpoint import load_checkpoint as _load_checkpoint
from ..api.module import TrainModule
from ..compat.lightning.data import add_worker_init_fn
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


#: ``launch()``'s default: join the job, run nothing (``launch(None)`` is a mistake, refused)
_JOIN_ONLY = object()


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
    def launch(self, function: Any = _JOIN_ONLY, *args: Any, **kwargs: Any) -> Any:
        """Join the job (the Engine's ``launch``); with ``function``, then run
        ``function(fabric, *args, **kwargs)`` on every rank and return this rank's result. A
        ``function`` that is not callable, or takes no argument, is a TypeError (Fabric's)."""
        if function is _JOIN_ONLY:
            return super().launch()
        _check_launch_function(function)
        super().launch()
        return function(self, *args, **kwargs)

    @property
    def node_rank(self) -> int:
        """This process's node (0 on one machine)."""
        return self._strategy.info.node_rank

    @property
    def loggers(self) -> list[Any]:
        return list(self._loggers)

    @property
    def logger(self) -> Any:
        return self._loggers[0] if self._loggers else None

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """``seed_everything`` with Fabric's default: the data-loader workers are seeded too
        (``workers=None`` is True), so the loaders ``setup_dataloaders`` returns get Lightning's
        ``worker_init_fn``."""
        return _seed_everything(seed, True if workers is None else workers, verbose)

    # ------------------------------------------------------------------ checkpoints, Fabric's way
    def load(self, path: Any, state: dict[str, Any] | None = None, strict: bool = True, *,
             weights_only: bool | None = None) -> dict[str, Any]:
        """Fabric's ``load``: with a model or optimizer ``setup`` returned in ``state``, the
        Engine's resumable load; otherwise the checkpoint (a zerotrain directory or one
        ``torch.save`` file) is read as a dict, the entries ``state`` names restored in place
        (``load_state_dict`` for objects) and the rest returned (all of it for ``state=None``).
        Read weights-only always (a checkpoint never runs code); ``strict=False`` is refused."""
        if not strict:
            raise ConfigError("Fabric.load: strict=False; valid: True (every entry asked for must be there)")
        if state is not None and any(self._is_setup_object(v) for v in state.values()):
            return super().load(os.fspath(path), state)
        path = os.fspath(path)
        saved = (_load_checkpoint(path) if os.path.isdir(path)  # zerotrain's directory, as Lightning's dict
                 else dict(torch.load(path, map_location="cpu", weights_only=True)))
        for key, obj in (state or {}).items():
            if key not in saved:
                raise KeyError(f"Fabric.load: {path} has no entry {key!r}")
            value = saved.pop(key)
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return saved

    def load_raw(self, path: Any, obj: Any, strict: bool = True, weights_only: bool | None = None) -> None:
        """Fabric's ``load_raw``: one ``torch.save`` file of a state dict into a module or optimizer
        (the user's, or the wrapper ``setup`` returned, under strategies that keep the whole model
        on each rank: single, ddp); read weights-only always."""
        wrapper = self._resolve(obj)
        strategy = getattr(wrapper, "_strategy", None) or getattr(wrapper, "strategy", None)
        if strategy is not None and not strategy.evaluates_without_optimizer:
            raise ConfigError(f"Fabric.load_raw: a {type(obj).__name__} set up under {strategy.name}, which "
                              "partitions it; valid: fabric.load(path, state) with a checkpoint fabric.save wrote")
        target = wrapper.module if isinstance(wrapper, EngineModule) else getattr(wrapper, "optimizer", wrapper)
        saved = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        if isinstance(target, nn.Module):
            target.load_state_dict(saved, strict=strict)
        else:
            target.load_state_dict(saved)

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
        """Each logger's ``log_metrics`` with the values as numbers (one-element tensors, in any
        nesting, ``.item()``-ed; a tensor of several elements is a ValueError, as Fabric's), on
        global rank 0."""
        self.launch()
        if not self.is_global_zero:
            return
        values = _scalars(metrics)
        for logger in self._loggers:
            logger.log_metrics(metrics=values, step=step)

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Every callback's ``hook_name`` (those without one are skipped; an attribute of that name
        that is not callable is skipped with a warning), as Fabric's: each gets only the keyword
        arguments its signature names, unless it takes ``**kwargs`` (all of them, also when its
        signature cannot be read)."""
        for callback in self._callbacks:
            method = getattr(callback, hook_name, None)
            if method is None:
                continue
            if not callable(method):
                warnings.warn(f"Skipping the callback `{type(callback).__name__}.{hook_name}` because it is not "
                              "callable.", UserWarning, stacklevel=2)
                continue
            method(*args, **_accepted_kwargs(method, kwargs))

    def barrier(self, name: str | None = None) -> None:
        """Collective: every rank waits here (``name`` is accepted for Fabric's signature)."""
        self.launch()
        super().barrier()

    def all_reduce(self, data: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        """Fabric's: a tensor or number, or each in any nesting of lists, tuples and dicts (other
        leaves kept), reduced over the ranks (``reduce_op``: "mean", "sum" or "max"); numbers
        become tensors as Fabric converts them. ``group`` is refused."""
        if group is not None:
            raise ConfigError(f"Fabric.all_reduce: group={group!r}; valid: None (all processes)")
        if reduce_op not in ("mean", "sum", "max"):
            raise ConfigError(f"Fabric.all_reduce: reduce_op={reduce_op!r}; valid: 'mean', 'sum', 'max'")
        self.launch()
        if isinstance(data, (list, tuple)):
            return type(data)(self.all_reduce(d, reduce_op=reduce_op) for d in data)
        if isinstance(data, dict):
            return {k: self.all_reduce(v, reduce_op=reduce_op) for k, v in data.items()}
        if not torch.is_tensor(data) and type(data) not in _NUMBER_DTYPES:
            return data
        tensor = _as_tensor(data).to(self.device)
        if self.world_size == 1:
            return tensor
        return super().all_reduce(tensor, op=reduce_op).to(tensor.dtype)

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
        data = _as_tensor(data)
        return data.to(self.device) if self.world_size == 1 else super().all_gather(data)

    def _resolve(self, model: Any) -> Any:
        return model._target() if isinstance(model, _PendingModule) else model

    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer, move_to_device: bool = True,
              _reapply_compile: bool = True) -> Any:
        """The Engine's ``setup``; a TrainModule (Lightning's LightningModule) then knows this Fabric,
        as under Fabric: its ``self.logger`` / ``self.loggers`` are the Fabric's. Callbacks'
        ``on_after_setup(fabric=, module=)`` run after it. An object ``setup`` already returned is
        refused (ValueError, as Fabric). ``move_to_device=False`` (Fabric: leave the parameters
        where they are) is accepted where that is the device anyway, the CPU; ``_reapply_compile``
        is accepted for Fabric's signature (a compiled model is compiled per block, README)."""
        _check_not_wrapped(model, optimizers, "setup")
        self._check_move(move_to_device)
        out = super().setup(model, *optimizers)
        model = getattr(model, "_orig_mod", model)  # setup(torch.compile(model))
        if isinstance(model, TrainModule):
            model.__dict__["_fabric"] = self
        self.call("on_after_setup", fabric=self, module=out[0] if isinstance(out, tuple) else out)
        return out

    def _check_move(self, move_to_device: bool) -> None:
        if not move_to_device and self.device.type != "cpu":
            raise ConfigError(f"Fabric.setup: move_to_device=False on {self.device}; valid: True (the strategy "
                              "places the parameters on this rank's device)")

    def _after_optimizer_step(self, optimizer: EngineOptimizer) -> None:
        self.call("on_after_optimizer_step", strategy=optimizer.strategy, optimizer=optimizer.optimizer)

    def setup_dataloaders(self, *dataloaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """The Engine's ``setup_dataloaders`` with Fabric's input checks: at least one loader
        (ValueError), each a torch ``DataLoader`` (TypeError), none that it returned before
        (ValueError)."""
        if not dataloaders:
            raise ConfigError("Fabric.setup_dataloaders: `setup_dataloaders` requires at least one dataloader; "
                              "valid: one or more torch DataLoaders")
        for loader in dataloaders:
            if isinstance(loader, EngineLoader):
                raise ConfigError("Fabric.setup_dataloaders: A dataloader should be passed only once to the "
                                  "`setup_dataloaders` method; valid: the DataLoader itself, not what it returned")
            if not isinstance(loader, DataLoader):
                raise TypeError(f"Fabric.setup_dataloaders: Only PyTorch DataLoader are currently supported in "
                                f"`setup_dataloaders`, got {type(loader).__name__}; valid: torch.utils.data.DataLoader")
        self.launch()
        for loader in dataloaders:  # seed_everything(workers=True) asked for seeded workers
            add_worker_init_fn(loader, self.global_rank)
        return super().setup_dataloaders(*dataloaders, move_to_device=move_to_device,
                                         use_distributed_sampler=use_distributed_sampler)

    # ------------------------------------------------------------------ set-up in two calls
    def setup_module(self, module: nn.Module, move_to_device: bool = True, _reapply_compile: bool = True) -> Any:
        """Fabric's first half of ``setup``. Under a strategy that runs a model without an
        optimizer (single, ddp) the model is set up now, as Fabric's (inference needs no
        ``setup_optimizers``); under ZeRO, whose strategy takes both together, it is held until
        ``setup_optimizers`` and the stand-in returned runs the module itself until then."""
        _check_not_wrapped(module, (), "setup_module")
        self._check_move(move_to_device)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"Fabric.setup_module: module={type(module).__name__}; valid: an nn.Module")
        if self._strategy.evaluates_without_optimizer:
            self._pending_module = self.setup(module)
            return self._pending_module
        self._pending_module = module
        return _PendingModule(self, module)

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """The second half: the optimizers of the module from ``setup_module`` (set up with it
        now, or handed to its strategy); returns the optimizer wrapper (a tuple for several)."""
        _check_not_wrapped(None, optimizers, "setup_optimizers")
        module, self._pending_module = self._pending_module or self._model_without_optimizer(optimizers), None
        if module is None:
            raise ConfigError("Fabric.setup_optimizers: no module set up; valid: fabric.setup_module(model) "
                              "first, or fabric.setup(model, optimizer)")
        if not isinstance(module, EngineModule):
            _, *wrapped = self.setup(module, *optimizers)
        else:
            wrapped = self._optimizers_of(module, optimizers)
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _model_without_optimizer(self, optimizers: Sequence[Any]) -> EngineModule | None:
        """The model that ``setup(model)`` set up alone (no optimizer yet) whose parameters
        ``optimizers`` step: Fabric's ``setup(model)`` then ``setup_optimizers(optimizer)``, the order
        FSDP and ModelParallel scripts use (the optimizer is built on the parallelized parameters)."""
        wanted = {id(p) for o in optimizers if isinstance(o, torch.optim.Optimizer)
                  for g in o.param_groups for p in g["params"]}
        for m in reversed(self._models):
            if any(o.strategy is m._strategy for o in self._optimizers):
                continue
            if any(id(p) in wanted for p in m.module.parameters()):
                return m
        return None

    def _optimizers_of(self, model: EngineModule, optimizers: Sequence[torch.optim.Optimizer]) -> list[Any]:
        """``optimizers`` handed to the strategy of ``model``, set up without one."""
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise ConfigError(f"Fabric.setup_optimizers: {len(optimizers)} optimizers given; valid: one or more "
                              "torch.optim.Optimizer, built on the model's parameters")
        s = model._strategy
        try:
            s.setup_optimizer(optimizers[0] if len(optimizers) == 1 else OptimizerSet(optimizers))
        except ValueError as exc:
            raise ConfigError(f"Fabric.setup_optimizers: {exc}") from None
        opts = [EngineOptimizer(self, o, k if len(optimizers) > 1 else None, s) for k, o in enumerate(optimizers)]
        self._optimizers.extend(opts)
        if self._model is model and self._optimizer is None:
            self._optimizer = opts[0]
        return opts


#: Fabric's conversion of numbers to tensors (all_gather, all_reduce)
_NUMBER_DTYPES = {bool: torch.uint8, int: torch.int32, float: torch.float32}


def _as_tensor(data: Any) -> torch.Tensor:
    if torch.is_tensor(data):
        return data
    dtype = _NUMBER_DTYPES.get(type(data))
    return torch.tensor(data, dtype=dtype) if dtype is not None else torch.as_tensor(data)


def _scalars(data: Any) -> Any:
    """One-element tensors (in any nesting of dicts, lists, tuples) as Python numbers."""
    if isinstance(data, dict):
        return {k: _scalars(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_scalars(v) for v in data)
    if torch.is_tensor(data):
        if data.numel() != 1:
            raise ValueError(f"The metric `{data}` does not contain a single element, thus it cannot be converted "
                             "to a scalar.")
        return data.item()
    return data


def _accepted_kwargs(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``method``'s signature takes (all with ``**kwargs`` or an unreadable
    signature)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def _check_launch_function(function: Any) -> None:
    if not callable(function):
        raise TypeError(f"Fabric.launch(function): function={function!r}; the function needs to be a callable "
                        "taking the Fabric as its first argument: fabric.launch(train), not fabric.launch(train(...))")
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        raise TypeError(f"Fabric.launch(function): {getattr(function, '__name__', function)} needs to take at least "
                        "one argument: the launcher calls it as function(fabric, *args, **kwargs)")


def _check_not_wrapped(model: Any, optimizers: Sequence[Any], method: str) -> None:
    """Fabric's refusal of what ``setup`` returned, given to a set-up method again."""
    if isinstance(getattr(model, "_orig_mod", model), (EngineModule, _PendingModule)):
        raise ConfigError(f"Fabric.{method}: A model should be passed only once to the `{method}` method; valid: "
                          "the nn.Module itself, not what setup returned")
    if any(isinstance(o, EngineOptimizer) for o in optimizers):
        raise ConfigError(f"Fabric.{method}: An optimizer should be passed only once to the `{method}` method; "
                          "valid: the torch optimizer itself, not what setup returned")


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
