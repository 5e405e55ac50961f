"""``deepspeed.checkpointing``: DeepSpeed's activation checkpointing API, on torch's.

``checkpoint(function, *args, **kwargs)`` runs ``function`` without keeping the activations it
computes; the backward runs it again (``torch.utils.checkpoint``, reentrant like DeepSpeed's
``checkpoint``; ``non_reentrant_checkpoint`` is the non-reentrant one, which also trains segments
whose inputs need no gradient). The second run sees the random-number state of the first (the
default generators, restored by torch, and the named streams of ``get_cuda_rng_tracker()``,
restored here), so dropout draws the same masks and the gradients are those of the plain model.

``configure`` sets the options as DeepSpeed's does: every call starts from DeepSpeed's defaults,
then the ``activation_checkpointing`` section of ``deepspeed_config`` (a dict or a JSON path),
then the arguments that are not None. ``deepspeed.initialize`` checks that section but does not
apply it (DeepSpeed 0.19.8's does not either: only ``configure`` reads it). What each option does here:

* ``cpu_checkpointing`` (``checkpoint_in_cpu``): the inputs ``checkpoint`` keeps for the backward
  are held in pinned CPU memory (``torch.autograd.graph.save_on_cpu``) when they are on the GPU;
  on the CPU there is nothing to move. ``non_reentrant_checkpoint`` keeps its inputs where they are.
* ``synchronize_checkpoint_boundary`` (``synchronize``): the accelerator is synchronised before and
  after each run of a checkpointed function (the forward and the recomputation).
* ``profile``: each run's time is logged (INFO, global rank 0).
* ``partition_activations``, ``contiguous_memory_optimization`` and ``number_checkpoints``:
  DeepSpeed splits each kept input over the model-parallel ranks (and copies the pieces into
  contiguous buffers sized by ``number_checkpoints``). zerotrain has no model parallelism, so a
  partition over one rank is the whole input: accepted without effect, with DeepSpeed's own checks.

``configure``'s ``mpu_`` is accepted when its model-parallel size is 1, and refused otherwise.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ...errors import ConfigError
from . import comm
from .accelerator import get_accelerator
from .config import ActivationCheckpointing, activation_checkpointing_spec, load_config

log = logging.getLogger("zerotrain")

#: the name of the stream ``model_parallel_cuda_manual_seed`` adds (DeepSpeed's and Megatron's)
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: added to the seed for that stream (DeepSpeed's and Megatron's offset, so the streams match theirs)
MODEL_PARALLEL_SEED_OFFSET = 2718

_settings = ActivationCheckpointing()
_configured = False


# ---------------------------------------------------------------------------- configuration
def _model_parallel_size(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    raise ConfigError(f"checkpointing.configure: mpu_={type(mpu).__name__} has no get_model_parallel_world_size; "
                      "valid: None, or a model-parallel unit of size 1")


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's ``configure``: defaults, then ``deepspeed_config``'s section, then the
    arguments given. A bad value is a ConfigError naming the config key it sets
    (``contiguous_checkpointing`` is ``contiguous_memory_optimization``, ``num_checkpoints``
    ``number_checkpoints``, ``checkpoint_in_cpu`` ``cpu_checkpointing``, ``synchronize``
    ``synchronize_checkpoint_boundary``)."""
    global _settings, _configured
    if mpu_ is not None and _model_parallel_size(mpu_) != 1:
        raise ConfigError(f"checkpointing.configure: mpu_ with model-parallel size {_model_parallel_size(mpu_)}; "
                          "valid: None or size 1 (zerotrain.deepspeed trains data-parallel only)")
    base = ActivationCheckpointing()
    if deepspeed_config is not None:
        base = activation_checkpointing_spec(load_config(deepspeed_config))
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    _settings = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    _configured = True
    if comm.get_rank() == 0:
        log.info("deepspeed.checkpointing: %s", _settings)


def is_configured() -> bool:
    """Whether ``configure`` has been called (as DeepSpeed's: ``checkpoint`` works either way)."""
    return _configured


def settings() -> ActivationCheckpointing:
    """The options in force (DeepSpeed's defaults until ``configure``)."""
    return _settings


def reset() -> None:
    """DeepSpeed's frees its contiguous buffers and drains its CPU copies (called between
    evaluation forwards); here nothing is held between calls, so there is nothing to free."""


# ---------------------------------------------------------------------------- random-number streams
class CudaRNGStatesTracker:
    """Named random-number streams of the accelerator (DeepSpeed's and Megatron's tracker, under
    its name): ``add(name, seed)`` starts one, ``with fork(name):`` draws from it and leaves the
    default generator as it was. On the CPU accelerator the streams are the CPU generator's."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used; valid: a new seed")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: stream {name!r} exists; valid: a new name")
        self.seeds_.add(seed)
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.manual_seed(seed)
        self.states_[name] = acc.get_rng_state()
        acc.set_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.fork: no stream {name!r}; valid: {sorted(self.states_)} "
                             "(add it first, or call model_parallel_cuda_manual_seed)")
        acc = get_accelerator()
        before = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            acc.set_rng_state(before)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the accelerator with ``seed`` and start the model-parallel stream at
    ``seed + 2718`` (plus the tensor-parallel rank in DeepSpeed, always 0 here), as DeepSpeed does."""
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET)


# ---------------------------------------------------------------------------- checkpointed functions
class _Segment:
    """One checkpointed call of ``function``: the positional and keyword arguments arrive
    flattened (torch's reentrant checkpoint takes positional ones only, and a tensor passed by
    keyword must take part in autograd as a positional one does). The first call is the forward;
    a later one is the recomputation in backward, run with the tracker's streams as the forward
    saw them."""

    def __init__(self, function: Callable[..., Any], n_positional: int, keys: tuple[str, ...],
                 options: ActivationCheckpointing) -> None:
        self.function, self.n_positional, self.keys, self.options = function, n_positional, keys, options
        self.streams = _TRACKER.get_states()
        self.calls = 0

    def __call__(self, *flat: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self._run("forward", flat)
        current = _TRACKER.get_states()
        _TRACKER.set_states(dict(self.streams))
        try:
            return self._run("recomputation", flat)
        finally:
            _TRACKER.set_states(current)

    def _run(self, phase: str, flat: tuple[Any, ...]) -> Any:
        o = self.options
        timed = o.synchronize_checkpoint_boundary or o.profile
        if timed:
            get_accelerator().synchronize()
        start = time.perf_counter()
        try:
            return self.function(*flat[:self.n_positional], **dict(zip(self.keys, flat[self.n_positional:])))
        finally:  # also when torch's non-reentrant recomputation stops early (it raises to stop)
            if timed:
                get_accelerator().synchronize()
            if o.profile and comm.get_rank() == 0:
                log.info("deepspeed.checkpointing: %s of %s: %.3f ms", phase,
                         getattr(self.function, "__name__", type(self.function).__name__),
                         1000 * (time.perf_counter() - start))


def _on_gpu(values: tuple[Any, ...]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)


def _checkpointed(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  reentrant: bool) -> Any:
    if not torch.is_grad_enabled():  # nothing is kept without autograd: a plain call is the same
        return function(*args, **kwargs)
    o = _settings
    flat = args + tuple(kwargs.values())
    segment = _Segment(function, len(args), tuple(kwargs), o)
    on_cpu = o.cpu_checkpointing and reentrant and _on_gpu(flat)
    with torch.autograd.graph.save_on_cpu(pin_memory=True) if on_cpu else contextlib.nullcontext():
        return torch_checkpoint(segment, *flat, use_reentrant=reentrant, preserve_rng_state=True)


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``checkpoint``: ``function(*args, **kwargs)``, its activations recomputed in
    backward (reentrant: as in DeepSpeed, parameters inside get no gradient when no tensor
    input requires one; ``non_reentrant_checkpoint`` has no such limit)."""
    return _checkpointed(function, args, kwargs, reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: as ``checkpoint``, through torch's non-reentrant
    checkpoint (works when no input requires a gradient; ``cpu_checkpointing`` does not apply)."""
    return _checkpointed(function, args, {}, reentrant=False)


__all__ = ["checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "settings",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker"]
