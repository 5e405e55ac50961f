"""``zerotrain.utilities``: Lightning's rank-zero helpers and ``seed_everything`` under their
Lightning names (``lightning.pytorch.utilities``), for code ported by renaming the import."""
from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import random
import warnings as _warnings  # the name ``warnings`` is Lightning's path here (utilities.warnings)
from typing import Any, Callable, Iterator, TypeVar

import torch

from .errors import ConfigError
from .api.hparams import AttributeDict, is_picklable

log = logging.getLogger("zerotrain")
F = TypeVar("F", bound=Callable[..., Any])


def distributed_is_initialized() -> bool:
    """A default process group exists (torch built with distributed support, and it was initialized)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's global rank, read when asked (not at import: the launcher sets ``RANK`` for
    rank 0 only when ``fit`` starts): the process group's, else ``RANK``, ``SLURM_PROCID``, 0."""
    import torch.distributed as dist

    if distributed_is_initialized():
        return dist.get_rank()
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _RankZeroOnly:
    """``@rank_zero_only`` runs the function on global rank 0 and returns None elsewhere;
    ``rank_zero_only.rank`` is the current global rank, as in Lightning."""

    @property
    def rank(self) -> int:
        return global_rank()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if global_rank() == 0 else None

        return wrapped  # type: ignore[return-value]


rank_zero_only = _RankZeroOnly()


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    log.info(*args, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, **kwargs: Any) -> None:
    log.debug(*args, **kwargs)


class GradClipAlgorithmType(str, enum.Enum):
    """Lightning's names for ``gradient_clip_algorithm``; equal to the strings ``"norm"`` / ``"value"``."""

    NORM = "norm"
    VALUE = "value"


class PossibleUserWarning(UserWarning):
    """A warning that may be a false positive (Lightning's class of the same name, under both its
    paths): zerotrain warns with it where Lightning does, e.g. ``max_epochs`` defaulted to 1000."""


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore ``PossibleUserWarning`` (from the modules matching the regex ``module``; all by default)."""
    _warnings.filterwarnings("ignore", category=PossibleUserWarning, module=module)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 4) -> None:
    _warnings.warn(message, category, stacklevel=stacklevel)


#: where ``seed_everything`` records its seed, for the DistributedSampler (``Trainer.data_seed``);
#: an environment variable so the ranks a launcher starts inherit it (Lightning's name)
GLOBAL_SEED_ENV = "PL_GLOBAL_SEED"
#: ``seed_everything(workers=True)`` recorded (Lightning's name): the Trainer then gives each loader
#: without a ``worker_init_fn`` Lightning's worker seeding (trainer/compat/lightning/data.py)
SEED_WORKERS_ENV = "PL_SEED_WORKERS"
#: the largest seed ``seed_everything`` takes (numpy's RNG takes 32 bits)
MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Lightning's ``seed_everything``: seed Python's, torch's (every device) and numpy's global
    RNGs and record the seed as the DistributedSampler's, in the environment, so that launched ranks
    inherit it (``PL_GLOBAL_SEED``, Lightning's variable). ``None`` takes the recorded seed, else 0
    with a warning (not with ``verbose=False``). A seed numpy cannot take (outside 0 .. 2**32 - 1)
    is a ValueError, as Lightning's. ``workers`` is recorded too (``PL_SEED_WORKERS``): with True,
    the Trainer gives each DataLoader without a ``worker_init_fn`` one that seeds each worker's
    torch, numpy and ``random`` as Lightning's does. Returns the seed."""
    if seed is None:
        env = os.environ.get(GLOBAL_SEED_ENV)
        if env is None and verbose:
            _warnings.warn("seed_everything(): No seed found, seed set to 0 (no seed given, none recorded in "
                           f"{GLOBAL_SEED_ENV})", stacklevel=2)
        try:
            seed = int(env) if env is not None else 0
        except ValueError:
            raise ConfigError(f"seed_everything: Invalid seed specified via {GLOBAL_SEED_ENV}={env!r}; valid: an "
                              f"integer from 0 to {MAX_SEED}") from None
    seed = int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed_everything: seed={seed}; valid: an integer from 0 to {MAX_SEED} (numpy's range; "
                          f"{seed} is not in bounds)")
    if verbose:
        log.info("Seed set to %d", seed)
    os.environ[GLOBAL_SEED_ENV] = str(seed)
    os.environ[SEED_WORKERS_ENV] = str(int(workers))
    seed_rngs(seed)
    return seed


def sampler_seed(seed: int | None) -> int:
    """The DistributedSampler's seed: ``seed`` when given, else the one ``seed_everything`` recorded
    (ours, else Lightning's ``PL_GLOBAL_SEED``, as Fabric reads it), else 0."""
    if seed is not None:
        return seed
    return int(os.environ.get(GLOBAL_SEED_ENV, 0))


def reset_seed() -> None:
    """Lightning's ``reset_seed``: a distributed run re-seeds each rank's global RNGs, as it joins
    the job, from the seed ``seed_everything`` recorded (nothing when none was), so every rank
    starts ``fit`` from the same RNG state whatever the script did between seeding and ``fit``."""
    seed = os.environ.get(GLOBAL_SEED_ENV)
    if seed is not None:
        seed_rngs(int(seed))


def seed_rngs(seed: int) -> None:
    """Seed the global RNGs only (``Trainer(seed=...)``, whose sampler seed is its own)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


@contextlib.contextmanager
def isolate_rng(include_cuda: bool = True) -> Iterator[None]:
    """Lightning's ``isolate_rng``: Python's, numpy's, torch's (and CUDA's) global RNG states are
    put back as they were when the block ends."""
    states: list[tuple[Callable[[Any], Any], Any]] = [(random.setstate, random.getstate()),
                                                       (torch.set_rng_state, torch.get_rng_state())]
    if include_cuda and torch.cuda.is_available():
        states.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all()))
    try:
        import numpy as np

        states.append((np.random.set_state, np.random.get_state()))
    except ImportError:
        pass
    try:
        yield
    finally:
        for restore, state in states:
            restore(state)


def is_overridden(method_name: str, instance: Any = None, parent: "type | None" = None) -> bool:
    """Lightning's ``is_overridden``: ``instance``'s class (or the class itself) defines
    ``method_name`` otherwise than ``parent`` (by default the TrainModule, DataModule or Callback base
    it derives from). ``None``, or a wrapper of ``None``, is never overridden."""
    if instance is None:
        return False
    if parent is None:
        from ..callbacks.base import Callback
        from .api.datamodule import DataModule
        from .api.module import TrainModule

        cls = instance if isinstance(instance, type) else type(instance)
        parent = next((base for base in (TrainModule, DataModule, Callback) if issubclass(cls, base)), None)
        if parent is None:
            raise ValueError("Expected a parent")
    mine = getattr(instance, method_name, None)
    if mine is None:
        return False
    theirs = getattr(parent, method_name, None)
    if theirs is None:
        raise ValueError(f"{parent.__name__} has no method {method_name!r}")
    mine = _unwrap(mine)
    if mine is None:  # a wrapper (functools.wraps, a partial) of None: the hook was switched off
        return False
    return mine is not _unwrap(theirs)


def _unwrap(fn: Any) -> Any:
    """The function under methods, ``functools.wraps`` wrappers and partials (each peeled in turn)."""
    for _ in range(100):  # a bound against cycles
        if hasattr(fn, "__func__"):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        else:
            return fn
        if fn is None:
            return None
    return fn


def get_torchvision_model(model_name: str, **kwargs: Any) -> torch.nn.Module:
    """torchvision's model ``model_name`` built with ``kwargs`` (``weights="DEFAULT"`` and so on):
    ``torchvision.models.get_model``; ModuleNotFoundError without torchvision."""
    try:
        from torchvision import models
    except ImportError as err:
        raise ModuleNotFoundError(f"get_torchvision_model({model_name!r}) needs torchvision: {err}") from err
    get = getattr(models, "get_model", None)  # torchvision >= 0.14
    return get(model_name, **kwargs) if get is not None else getattr(models, model_name)(**kwargs)


__all__ = ["GLOBAL_SEED_ENV", "get_torchvision_model", "is_overridden", "is_picklable", "isolate_rng", "AttributeDict", "reset_seed", "seed_rngs", "rank_zero_only", "rank_zero_info", "rank_zero_debug", "rank_zero_warn", "seed_everything",
           "global_rank", "distributed_is_initialized", "PossibleUserWarning", "disable_possible_user_warnings"]
