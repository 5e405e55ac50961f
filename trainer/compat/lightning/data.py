"""Lightning's data-loader helpers (``lightning.fabric.utilities.data``,
``lightning.pytorch.utilities.data``): whether a loader has a length (on every rank), is over an
iterable dataset, and the worker seeding ``seed_everything(workers=True)`` asks for."""
from __future__ import annotations

import functools
import os
import random
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ...utilities import SEED_WORKERS_ENV, rank_zero_warn


def has_iterable_dataset(dataloader: object) -> bool:
    """``dataloader.dataset`` is an ``IterableDataset``."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def sized_len(dataloader: object) -> int | None:
    """``len(dataloader)``, or None where it has none (or its dataset's raises)."""
    try:
        return len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def has_len(dataloader: object) -> bool:
    """``dataloader`` has a length; a zero one warns (Lightning's check), an iterable dataset's
    warns too (each worker may yield all of it)."""
    length = sized_len(dataloader)
    if length == 0:
        rank_zero_warn(f"`{type(dataloader).__name__}` returned 0 length. Please make sure this was your intention.")
    if length is not None and has_iterable_dataset(dataloader):
        _warn_iterable_len()
    return length is not None


def _warn_iterable_len() -> None:
    rank_zero_warn("Your `IterableDataset` has `__len__` defined. In combination with multi-process data loading "
                   "(when num_workers > 1), `__len__` could be inaccurate if each worker is not configured "
                   "independently to avoid having duplicate data.")


def has_len_all_ranks(dataloader: object, strategy: Any = None,
                      allow_zero_length_dataloader_with_multiple_devices: bool = False) -> bool:
    """``dataloader`` has a length on this rank; summed over ``strategy``'s ranks (when it runs
    several), a zero total warns, and an empty rank where others have batches raises RuntimeError
    (a warning with ``allow_zero_length_dataloader_with_multiple_devices``), as Lightning's."""
    local = sized_len(dataloader)
    if local is None:
        return False
    total = local
    if strategy is not None and getattr(strategy, "distributed", False):
        total = int(strategy.reduce(torch.tensor(float(local)), op="sum").item())
    name = type(dataloader).__name__
    if total == 0:
        rank_zero_warn(f"Total length of `{name}` across ranks is zero. Please make sure this was your intention.")
    if total > 0 and local == 0:
        if not allow_zero_length_dataloader_with_multiple_devices:
            raise RuntimeError(f"`{name}` within local rank has zero length. Please make sure that it returns at "
                               "least 1 batch.")
        rank_zero_warn(f"Total length of `{name}` across ranks is zero, but local rank has zero length. Please be "
                       "cautious of uneven batch length.")
    if has_iterable_dataset(dataloader):
        _warn_iterable_len()
    return True


def _num_cpus_available() -> int:
    """CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def suggested_max_num_workers(local_world_size: int) -> int:
    """Data-loader workers per process that leave one CPU per process free (at least 1)."""
    if local_world_size < 1:
        raise ValueError(f"`local_world_size` should be >= 1, got {local_world_size}.")
    return max(1, _num_cpus_available() // local_world_size - 1)


_MASK64 = (1 << 64) - 1


def _worker_seeds(base: int, worker_id: int, rank: int, count: int) -> list[int]:
    """``count`` 64-bit seeds from (base seed, worker id, rank): the three packed into one 64-bit
    word, mixed by MurmurHash3's 64-bit finalizer, then drawn from Knuth's MMIX linear
    congruential generator (multiplier 6364136223846793005, increment 1, modulus 2**64)."""
    x = (base << 32) | (worker_id << 16) | rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        x = ((x ^ (x >> 33)) * multiplier) & _MASK64
    x ^= x >> 33
    seeds = []
    for _ in range(count):
        x = (x * 6364136223846793005 + 1) & _MASK64
        seeds.append(x)
    return seeds


def seed_worker(worker_id: int, rank: int | None = None) -> None:
    """A data-loader worker's ``worker_init_fn``: seed its torch, ``random`` and numpy RNGs from
    (the worker's base seed, its id, the global rank), so workers and ranks draw different numbers
    and a seeded run draws the same ones again - the streams of Lightning's
    ``pl_worker_init_function`` (torch and ``random`` from ``_worker_seeds``, numpy from a
    ``SeedSequence`` of the same three numbers)."""
    from ...utilities import global_rank

    rank = global_rank() if rank is None else rank
    base = torch.initial_seed() - worker_id
    seeds = _worker_seeds(base, worker_id, rank, 4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(np.random.SeedSequence([base, worker_id, rank]).generate_state(4))


def add_worker_init_fn(dataloader: object, rank: int) -> None:
    """Give ``dataloader`` the seeding ``worker_init_fn`` (for global rank ``rank``) when
    ``seed_everything(workers=True)`` asked for it and it has none of its own."""
    if getattr(dataloader, "worker_init_fn", None) is None and int(os.environ.get(SEED_WORKERS_ENV, 0)):
        dataloader.worker_init_fn = functools.partial(seed_worker, rank=rank)  # type: ignore[attr-defined]


_auto_add_worker_init_fn = add_worker_init_fn  # Lightning's name (lightning.fabric.utilities.data)


def _request_dataloader(source: Any) -> Any:
    """The loader a source gives: a ``*_dataloader`` hook's result (``source.dataloader()`` for
    Lightning's data-source objects, or a callable), else the object itself."""
    if hasattr(source, "dataloader"):
        return source.dataloader()
    return source() if callable(source) else source
