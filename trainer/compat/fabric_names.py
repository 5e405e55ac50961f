"""Names Lightning Fabric's users and tests import from ``lightning.fabric`` paths zerotrain has no
module of its own for (registered by ``fabric_paths.py``): the set-up wrappers under Fabric's names
(``wrappers``: the Engine's ``EngineModule`` / ``EngineOptimizer`` / ``EngineLoader`` and the helpers
that recognize or unwrap them), the RNG-state and worker-seed helpers of ``utilities.seed``,
``utilities.apply_func``'s collection helpers, a module mixin that tracks its device and dtype, and
Fabric's strategy names. zerotrain's strategies are its own (``strategy="ddp"``, ``"zero2"``, ...);
Fabric's strategy classes it has no counterpart of are names whose construction raises
``NotImplementedError`` saying so."""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import nn

from ..engine.wrappers import EngineLoader, EngineModule, EngineOptimizer
from ..loop.evaluation import to_device as _to_device
from .lightning.data import _worker_seeds
from .lightning.internals import _internal

# ---------------------------------------------------------------------- wrappers


def _unwrap_compiled(obj: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(module, compile arguments)`` for a ``torch.compile``-d module (the arguments it recorded,
    else ``{}``: zerotrain does not patch ``torch.compile`` to record them), else ``(obj, None)``."""
    from torch._dynamo import OptimizedModule

    if isinstance(obj, OptimizedModule):
        return obj._orig_mod, dict(getattr(obj, "_compile_kwargs", None) or {})
    return obj, None


def is_wrapped(obj: object) -> bool:
    """``obj`` (or the module under its ``torch.compile``) was handed back by ``Fabric.setup*``."""
    return isinstance(_unwrap_compiled(obj)[0], (EngineModule, EngineOptimizer, EngineLoader))


def _unwrap_one(obj: Any) -> Any:
    inner = _unwrap_compiled(obj)[0]
    if isinstance(inner, EngineModule):
        return _unwrap_compiled(inner.module)[0]
    if isinstance(inner, EngineOptimizer):
        return inner.optimizer
    if isinstance(inner, EngineLoader):
        return inner.loader
    return obj


def _unwrap_objects(collection: Any) -> Any:
    """``collection`` (any nesting of lists, tuples and dicts) with each set-up model, optimizer and
    loader replaced by the user's own object."""
    return apply_to_collection(collection, object, _unwrap_one)


# ---------------------------------------------------------------------- apply_func


def apply_to_collection(data: Any, dtype: type | tuple[type, ...], function: Callable, *args: Any,
                        **kwargs: Any) -> Any:
    """``function(x, *args, **kwargs)`` for each ``x`` of type ``dtype`` in ``data``, through lists,
    tuples (named ones too) and dicts, whose types are kept; other leaves are returned as they are."""
    if isinstance(data, dtype) and not isinstance(data, (list, tuple, dict)):
        return function(data, *args, **kwargs)
    if isinstance(data, dict):
        return type(data)({k: apply_to_collection(v, dtype, function, *args, **kwargs) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(apply_to_collection(v, dtype, function, *args, **kwargs) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_collection(v, dtype, function, *args, **kwargs) for v in data)
    return data


def move_data_to_device(batch: Any, device: "torch.device | str | int") -> Any:
    """Tensors in ``batch`` (any nesting) and objects with a ``to(device)`` moved to ``device``; an
    object whose ``to`` returns nothing (moved in place) is kept as it is."""
    device = torch.device(device) if not isinstance(device, torch.device) else device

    def move(obj: Any) -> Any:
        if torch.is_tensor(obj):
            return obj.to(device, non_blocking=device.type == "cuda")
        moved = obj.to(device)
        return obj if moved is None else moved

    return apply_to_collection(batch, object, lambda x: move(x) if callable(getattr(x, "to", None)) else x)


def convert_tensors_to_scalars(data: Any) -> Any:
    """Each tensor in ``data`` (any nesting) as its Python number; a ValueError for one with more
    than one element."""
    def scalar(t: torch.Tensor) -> Any:
        if t.numel() != 1:
            raise ValueError(f"The metric `{t}` does not contain a single element, thus it cannot be converted to a "
                             "scalar.")
        return t.item()

    return apply_to_collection(data, torch.Tensor, scalar)


# ---------------------------------------------------------------------- seed


def _generate_seed_sequence(base_seed: int, worker_id: int, global_rank: int, count: int) -> list[int]:
    """``count`` seeds for a data-loader worker (the streams ``pl_worker_init_function`` seeds from)."""
    return _worker_seeds(base_seed, worker_id, global_rank, count)


def _collect_rng_states(include_cuda: bool = True) -> dict[str, Any]:
    """The global RNG states: torch's, numpy's, Python's, and CUDA's (when it is usable)."""
    import numpy as np

    states: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                              "python": random.getstate()}
    if include_cuda:
        try:
            states["torch.cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        except RuntimeError:  # a CUDA that fails to initialize: no CUDA state
            states["torch.cuda"] = []
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    """Put back what ``_collect_rng_states`` returned (states it lacks are left alone)."""
    import numpy as np

    torch.set_rng_state(states["torch"])
    if states.get("torch.cuda"):
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    np.random.set_state(states["numpy"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


# ---------------------------------------------------------------------- device and dtype


class _DeviceDtypeModuleMixin(nn.Module):
    """A module that knows the device and floating dtype it was last moved to (``to``, ``cuda``,
    ``cpu``, ``type``, ``float``, ``double``, ``half``, ``bfloat16``)."""

    def __init__(self) -> None:
        super().__init__()
        self._dtype: torch.dtype = torch.get_default_dtype()
        self._device = torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        device = self._device
        if device.type == "cuda" and device.index is None:  # "cuda" means the current one
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _track(self, device: Any = None, dtype: Any = None) -> None:
        for m in self.modules():
            if isinstance(m, _DeviceDtypeModuleMixin):
                if device is not None:
                    m._device = torch.device(device)
                if dtype is not None:
                    m._dtype = dtype

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        self._track(device, dtype if dtype is not None and dtype.is_floating_point else None)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Any:
        index = device.index if isinstance(device, torch.device) else device
        self._track(torch.device("cuda", index if index is not None else torch.cuda.current_device()))
        return super().cuda(device)

    def cpu(self) -> Any:
        self._track(torch.device("cpu"))
        return super().cpu()

    def type(self, dst_type: Any) -> Any:
        self._track(dtype=dst_type)
        return super().type(dst_type)

    def float(self) -> Any:
        self._track(dtype=torch.float)
        return super().float()

    def double(self) -> Any:
        self._track(dtype=torch.double)
        return super().double()

    def half(self) -> Any:
        self._track(dtype=torch.half)
        return super().half()

    def bfloat16(self) -> Any:
        self._track(dtype=torch.bfloat16)
        return super().bfloat16()


class _DtypeContextManager:
    """Inside, tensors are created with ``dtype`` as the default floating dtype (restored after)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype, self._before = dtype, torch.get_default_dtype()

    def __enter__(self) -> None:
        self._before = torch.get_default_dtype()
        torch.set_default_dtype(self._dtype)

    def __exit__(self, *exc: Any) -> None:
        torch.set_default_dtype(self._before)


# ---------------------------------------------------------------------- strategies


class _Sharded(ABC):
    """Fabric's mark of a strategy that shards a module as it is built: it has a context in which
    the module is instantiated."""

    @abstractmethod
    def module_sharded_context(self) -> AbstractContextManager:
        """The context to build the module in."""


_WHY = "zerotrain's strategies are named in Fabric(strategy=...): 'ddp', 'zero1', 'zero2', 'zero3', 'offload', ..."
ParallelStrategy = _internal("ParallelStrategy", "base of its multi-process strategies", why=_WHY)
DataParallelStrategy = _internal("DataParallelStrategy", "torch DataParallel strategy", why=_WHY)
DeepSpeedStrategy = _internal("DeepSpeedStrategy", "DeepSpeed strategy", why=_WHY + " (DeepSpeed's own API: "
                              "zerotrain.deepspeed)")
FSDPStrategy = _internal("FSDPStrategy", "FSDP strategy", why=_WHY)
XLAStrategy = _internal("XLAStrategy", "XLA (TPU) strategy", why=_WHY)
XLAFSDPStrategy = _internal("XLAFSDPStrategy", "XLA FSDP strategy", why=_WHY)


# ---------------------------------------------------------------------- rank_zero, logger, data, types


def _get_rank() -> int | None:
    """The global rank the launcher's environment names (``RANK``, then ``LOCAL_RANK``,
    ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``), else None."""
    import os

    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return None


def rank_zero_deprecation(message: str, stacklevel: int = 5, **kwargs: Any) -> None:
    """A ``DeprecationWarning`` on global rank 0 only."""
    import warnings

    from ..utilities import global_rank

    if global_rank() == 0:
        warnings.warn(message, kwargs.pop("category", DeprecationWarning), stacklevel=stacklevel)


def _convert_json_serializable(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with each value JSON cannot encode replaced by its ``str``."""
    import json

    def encodable(value: Any) -> bool:
        try:
            json.dumps(value)
            return True
        except (TypeError, OverflowError, ValueError):
            return False

    return {k: v if encodable(v) else str(v) for k, v in params.items()}


def _set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler, where they
    have one (each object once)."""
    seen: set[int] = set()
    for sampler in (getattr(dataloader, "sampler", None),
                    getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if sampler is not None and id(sampler) not in seen and callable(getattr(sampler, "set_epoch", None)):
            seen.add(id(sampler))
            sampler.set_epoch(epoch)


def _not_provided(name: str, what: str) -> Callable:
    def shim(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name}: Lightning Fabric's {what}; zerotrain has no such helper (its "
                                  "distributed loaders are built by trainer/launch/job.py)")

    shim.__name__ = shim.__qualname__ = name
    shim.__doc__ = f"Lightning Fabric's {what}: not provided by zerotrain (importable only)."
    return shim


_update_dataloader = _not_provided("_update_dataloader", "re-instantiation of a DataLoader with a new sampler")
_get_dataloader_init_args_and_kwargs = _not_provided("_get_dataloader_init_args_and_kwargs",
                                                     "reading of a DataLoader's constructor arguments")
_replace_dunder_methods = _not_provided("_replace_dunder_methods", "recording of constructor arguments")
_replace_value_in_saved_args = _not_provided("_replace_value_in_saved_args", "edit of recorded constructor arguments")
_WrapAttrTag = _internal("_WrapAttrTag", "tag of recorded attribute changes", why="see _replace_dunder_methods")
_is_path_in_lightning = _not_provided("_is_path_in_lightning", "check whether a file is Lightning's own")


def _tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


_TENSORBOARD_AVAILABLE = _tensorboard_available()


from typing import Protocol, runtime_checkable  # noqa: E402


@runtime_checkable
class Optimizable(Protocol):
    """What Fabric takes as an optimizer: steps, zeroes, has parameter groups and a state dict."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: Any

    def step(self, closure: Any = ...) -> Any: ...

    def zero_grad(self, set_to_none: bool = ...) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
