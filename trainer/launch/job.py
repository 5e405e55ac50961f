"""Joining the job and sharing the data over it: the set-up the Trainer and the Engine both need.

``join_job`` puts this process in the job the way ``Trainer.fit`` does (launch the other local
ranks, or join torchrun / SLURM / our launcher, then connect the strategy and its process group);
``distributed_loader`` gives each data-parallel rank its share of a map-style ``DataLoader``
(``SamplerShard``: its share of a sampler of the user's own, for the Trainer);
``plugins`` resolves the strategy and precision names. The Trainer and the Engine (``engine.py``)
both call all three, so both launch, connect and shard data the same way (the Trainer adds
Lightning's sampler warnings, ``use_distributed_sampler`` and its seeding around them).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Iterator, Sized

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler, SequentialSampler

from ...strategies import Precision, Strategy, precision_from_name, strategy_from_name
from ...strategies.environment import detect, in_launched_job, pick_device, set_cpu_threads
from . import elastic
from ..errors import ConfigError
from .launcher import LocalLauncher
from ..utilities import reset_seed, seed_rngs


def plugins(owner: str, strategy: str | Strategy, precision: str | int, world_size: int
            ) -> tuple[Precision, Strategy]:
    """The precision plugin and strategy named; ``strategy="auto"`` is ddp for several processes,
    single for one. A bad name is a ConfigError that names ``owner``."""
    if strategy == "auto":
        strategy = "ddp" if world_size > 1 else "single"
    try:
        plugin, built = precision_from_name(precision), strategy_from_name(strategy)
        built.check_world_size(detect(world_size).world_size)  # before any rank starts; under torchrun, its world
        built.check_precision(plugin, str(precision))
        if plugin.param_dtype == torch.float64 and not built.supports_float64:
            raise ValueError(f"precision={precision!r} with strategy={built.name!r}: float64 training keeps the "
                             "module whole; valid: strategy='single' or 'ddp' (or another precision)")
    except ValueError as exc:
        raise ConfigError(f"{owner}: {exc}") from None
    return plugin, built


def check_cuda(owner: str, accelerator: str, devices: int) -> None:
    """``accelerator="cuda"`` needs a CUDA device torch can use, and ``devices`` at most as many
    as there are: refused here, before any rank starts, as Lightning refuses it."""
    if accelerator != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{owner}: accelerator='cuda' but this machine has no CUDA device torch can use "
                          "(torch.cuda.is_available() is False); valid here: cpu, auto")
    if devices > torch.cuda.device_count():
        raise ConfigError(f"{owner}: devices={devices} with accelerator='cuda', but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")


def check_num_nodes(owner: str, num_nodes: int) -> None:
    """``num_nodes > 1`` needs the other nodes' ranks started by torchrun or SLURM: refused when
    built, before any rank starts (else the first collective at fit fails with a RuntimeError)."""
    if num_nodes > 1 and not in_launched_job():
        raise ConfigError(f"{owner}: num_nodes={num_nodes}: a multi-node job needs a multi-node launcher, and this "
                          "process was started without torchrun or SLURM; valid: 1 here, or start every node with "
                          "torchrun (--nnodes, --rdzv-backend c10d) or srun (see the README's multi-node section)")


def join_job(strategy: Strategy, precision: Precision, accelerator: str, devices: int,
             num_nodes: int = 1, seed: int | None = None) -> LocalLauncher | None:
    """Collective: make this process a rank of the job and connect ``strategy`` to it. A process
    that is not yet inside a job and asks for several devices becomes rank 0 and starts the other
    ranks by re-running its own command line (returned launcher); under torchrun, SLURM or a
    process group the user made, it joins. Ranks other than 0 log warnings only. The Trainer's and
    the Engine's ``seed`` (declaration.py): an int seeds every rank's global RNGs with it here;
    None leaves them as the user seeded them (``seed_everything``'s seed, re-applied on each rank
    of a distributed job, as Lightning and Fabric)."""
    info = detect(devices, num_nodes)
    launcher = None
    if info.must_launch:
        launcher = LocalLauncher(info)
        info = launcher.launch()
    set_cpu_threads(info)
    device = pick_device(accelerator, info.local_rank)
    strategy.connect(info, device, precision)
    strategy.launcher = launcher
    elastic.join_attempt_group(info, device, strategy.process_group_timeout_s)  # under torchelastic
    strategy.setup_environment()
    if info.world_size > 1:  # as Lightning's (and Fabric's) distributed strategies at set-up
        reset_seed()
    if seed is not None:
        seed_rngs(seed)
    if not strategy.is_global_zero:
        logging.getLogger("zerotrain").setLevel(logging.WARNING)
    return launcher


def shardable(loader: Any) -> bool:
    """A map-style ``DataLoader`` whose batches its sampler decides: a ``DataLoader``, not over an
    ``IterableDataset`` (Lightning leaves those alone too), and without a ``batch_sampler`` of the
    user's own (which would be lost when the loader is re-created around another sampler)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return False
    if not hasattr(loader.dataset, "__len__"):
        return False
    return not own_batch_sampler(loader)


def own_batch_sampler(loader: DataLoader) -> bool:
    """The user passed ``batch_sampler=`` (torch's DataLoader then has no ``batch_size``)."""
    return loader.batch_sampler is not None and loader.batch_size is None


def distributed_loader(loader: Any, strategy: Strategy, seed: int, custom_sampler_shuffle: bool | None = None,
                       shuffle: bool | None = None) -> Any:
    """``loader`` over a DistributedSampler with the same shuffle (``shuffle``, when given, instead:
    the Trainer's training loaders always shuffle, as Lightning's), so each data-parallel rank sees
    its share and the order is a pure function of (seed, epoch). A loader with a sampler of its
    own is kept as it is unless ``custom_sampler_shuffle`` is a bool and there are several ranks:
    then each rank gets its ``SamplerShard`` of that sampler (shuffled positions or not; the
    Trainer's choice, as Lightning's). Anything not ``shardable`` is returned as it is."""
    if not shardable(loader):
        return loader
    world, rank = strategy.data_parallel_world_size, strategy.data_parallel_rank
    if isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        sampler = DistributedSampler(loader.dataset, num_replicas=world, rank=rank, seed=seed, drop_last=False,
                                     shuffle=isinstance(loader.sampler, RandomSampler) if shuffle is None else shuffle)
    elif custom_sampler_shuffle is not None and world > 1:
        sampler = SamplerShard(loader.sampler, world, rank, shuffle=custom_sampler_shuffle, seed=seed)
    else:
        return loader
    options = loader_options(loader)
    # the user's generator (None: the global RNG), as Lightning re-creates the loader: each pass's
    # iterator draws its worker base seed from it, so the global RNG stream after a pass (dropout,
    # noise drawn in training_step) is Lightning's; ``epoch_iterator`` keeps a resumed pass exact
    return DataLoader(loader.dataset, sampler=sampler, generator=loader.generator, **options)


def loader_options(loader: DataLoader) -> dict[str, Any]:
    """The options a DataLoader is rebuilt with over another sampler (its dataset and generator
    aside)."""
    options = {name: getattr(loader, name) for name in (
        "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
        "persistent_workers")}
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


class SamplerShard(Sampler):
    """One rank's share of a sampler of the user's own, the indices Lightning's
    ``DistributedSamplerWrapper`` gives (our own code; ``tests/unit/test_samplers.py`` compares).

    Each pass lists the inner sampler's indices (in its order, after ``set_epoch`` was forwarded
    to it), permutes their positions by ``seed + epoch`` when ``shuffle`` (as a shuffled
    DistributedSampler permutes a dataset's; Lightning shuffles every training sampler), pads the
    list by repeating its start to a multiple of ``num_replicas`` (every rank runs as many
    batches) and yields every ``num_replicas``-th index from ``rank``. A pass is a pure function
    of (the inner sampler's list, seed, epoch): a run resumed mid-epoch sees the same pass again
    when the inner sampler's order depends on ``set_epoch`` alone, not on an RNG of its own."""

    def __init__(self, sampler: Sized, num_replicas: int, rank: int, shuffle: bool = False, seed: int = 0) -> None:
        try:
            n = len(sampler)
        except TypeError:
            n = None
        if n is None or n == math.inf:
            raise ConfigError(f"use_distributed_sampler=True: the DataLoader's sampler {type(sampler).__name__} "
                              f"has {'no' if n is None else 'an infinite'} length, so it cannot be split over "
                              f"{num_replicas} ranks; valid: a sampler with a finite __len__, or "
                              "use_distributed_sampler=False (each rank then samples for itself)")
        self.sampler, self.num_replicas, self.rank = sampler, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        indices = list(self.sampler)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
        total = math.ceil(len(indices) / self.num_replicas) * self.num_replicas
        if indices:
            indices = (indices * math.ceil(total / len(indices)))[:total]
        return iter(indices[self.rank::self.num_replicas])


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler, each once (as
    Lightning does before every training epoch and every evaluation run: a DistributedSampler
    reshuffles, a ``SamplerShard`` forwards it to the user's sampler); for several loaders
    combined (``flattened``: a CombinedLoader), on each of them."""
    if isinstance(getattr(loader, "flattened", None), list):
        for each in loader.flattened:
            set_sampler_epoch(each, epoch)
        return
    samplers = {id(s): s for s in (getattr(loader, "sampler", None),
                                   getattr(getattr(loader, "batch_sampler", None), "sampler", None)) if s is not None}
    for sampler in samplers.values():
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


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
