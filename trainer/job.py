"""Joining the job and sharing the data over it: the set-up the Trainer and the Engine both need.

``join_job`` puts this process in the job the way ``Trainer.fit`` does (launch the other local
ranks, or join torchrun / SLURM / our launcher, then connect the strategy and its process group);
``distributed_loader`` gives each data-parallel rank its share of a map-style ``DataLoader``;
``plugins`` resolves the strategy and precision names. The Trainer and the Engine (``engine.py``)
both call all three, so both launch, connect and shard data the same way (the Trainer adds
Lightning's sampler warnings, ``use_distributed_sampler`` and its seeding around them).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ..strategies import Precision, Strategy, precision_from_name, strategy_from_name
from ..strategies.environment import detect, pick_device, set_cpu_threads
from . import elastic
from .errors import ConfigError
from .launcher import LocalLauncher
from .utilities import reset_seed


def plugins(owner: str, strategy: str | Strategy, precision: str | int, world_size: int
            ) -> tuple[Precision, Strategy]:
    """The precision plugin and strategy named; ``strategy="auto"`` is ddp for several processes,
    single for one. A bad name is a ConfigError that names ``owner``."""
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "single"
    try:
        return precision_from_name(precision), strategy_from_name(strategy)
    except ValueError as exc:
        raise ConfigError(f"{owner}: {exc}") from None


def join_job(strategy: Strategy, precision: Precision, accelerator: str, devices: int,
             num_nodes: int = 1) -> LocalLauncher | None:
    """Collective: make this process a rank of the job and connect ``strategy`` to it. A process
    that is not yet inside a job and asks for several devices becomes rank 0 and starts the other
    ranks by re-running its own command line (returned launcher); under torchrun, SLURM or a
    process group the user made, it joins. Ranks other than 0 log warnings only."""
    info = detect(devices, num_nodes)
    launcher = None
    if info.must_launch:
        launcher = LocalLauncher(info)
        info = launcher.launch()
    set_cpu_threads(info)
    device = pick_device(accelerator, info.local_rank)
    strategy.connect(info, device, precision)
    elastic.join_attempt_group(info, device, strategy.process_group_timeout_s)  # under torchelastic
    strategy.setup_environment()
    if info.world_size > 1:  # as Lightning's (and Fabric's) distributed strategies at set-up
        reset_seed()
    if not strategy.is_global_zero:
        logging.getLogger("zerotrain").setLevel(logging.WARNING)
    return launcher


def distributed_loader(loader: Any, strategy: Strategy, seed: int) -> Any:
    """``loader`` over a DistributedSampler with the same shuffle, so each data-parallel rank sees
    its share and the order is a pure function of (seed, epoch). A loader with its own sampler,
    over an iterable dataset, or anything but a ``DataLoader`` is returned as it is."""
    if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__len__"):
        return loader
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        return loader
    sampler = DistributedSampler(loader.dataset, num_replicas=strategy.data_parallel_world_size,
                                 rank=strategy.data_parallel_rank, seed=seed, drop_last=False,
                                 shuffle=isinstance(loader.sampler, RandomSampler))
    options = {name: getattr(loader, name) for name in (
        "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
        "persistent_workers")}
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    # the user's generator (None: the global RNG), as Lightning re-creates the loader: each pass's
    # iterator draws its worker base seed from it, so the global RNG stream after a pass (dropout,
    # noise drawn in training_step) is Lightning's; ``epoch_iterator`` keeps a resumed pass exact
    return DataLoader(loader.dataset, sampler=sampler, generator=loader.generator, **options)


def epoch_iterator(loader: Any, resuming: bool) -> Iterator[Any]:
    """``iter(loader)`` for one pass. Starting a pass draws one number from the loader's generator
    (the global RNG when it has none: torch's DataLoader seeds its workers with it). A pass resumed
    mid-epoch was started before the checkpoint, whose RNG state already holds that draw: it is
    drawn again here and the global RNG put back, so the resumed run continues the uninterrupted
    one's stream exactly."""
    if not resuming:
        return iter(loader)
    state = torch.get_rng_state()
    try:
        return iter(loader)
    finally:
        torch.set_rng_state(state)
