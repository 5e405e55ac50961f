"""The Trainer's data: the datamodule's stages, the samplers put under each DataLoader, and the
batch limits (a mixin of :class:`~.trainer.Trainer`; ``evaluation.py`` uses it for its stages too)."""
from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Iterator

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from ..launch import job
from .fit import FitLoaders
from ..api.datamodule import DataModule, overrides_hook
from ..errors import ConfigError, MisconfigurationException
from ..loop.hooks import datamodule_hook
from ..compat.lightning import data as _data
from ..compat.lightning.data import add_worker_init_fn
from ..utilities import PossibleUserWarning, is_overridden, rank_zero_warn

log = logging.getLogger("zerotrain")


class TrainerData:
    """Where the Trainer's batches come from, and how many of them a stage runs."""

    def _setup_data(self, stage: str, datamodule: DataModule | None, module: Any = None) -> None:
        """Attach the datamodule (a later stage without one keeps the previous, as Lightning) and
        run its and the module's ``prepare_data`` once per node (or once, ``prepare_data_per_node
        = False``) while the other ranks wait, then the datamodule's ``setup(stage)`` on every rank."""
        if datamodule is not None:
            self.datamodule = datamodule
        dm = self.datamodule
        if dm is not None:
            dm.trainer = self
        s = self._strategy
        preparing = [owner for owner in (dm, module) if is_overridden("prepare_data", owner)]
        for owner in preparing:
            if (s.local_rank if getattr(owner, "prepare_data_per_node", True) else s.global_rank) == 0:
                if owner is dm:
                    datamodule_hook(self, dm, "prepare_data")
                else:
                    owner.prepare_data()
        if preparing:
            s.barrier()
        if dm is None:
            return
        datamodule_hook(self, dm, "setup", stage)
        self._dm_stage = stage

    _dm_stage: str | None = None

    def _teardown_data(self, stage: str) -> None:
        if self.datamodule is not None and self._dm_stage == stage:
            self._dm_stage = None
            datamodule_hook(self, self.datamodule, "teardown", stage)

    def _prepare_loader(self, loader: Any, stage: str) -> Any:
        """Put a DistributedSampler under map-style data, so each data-parallel rank sees its
        share and the order is a pure function of (``data_seed``, epoch) - Lightning's sampler,
        shuffled for training (even when the loader does not: Lightning's order, with a warning),
        as the loader is for evaluation, ``set_epoch(epoch)`` every training epoch. A sampler of
        the user's own is split over several ranks as Lightning's ``DistributedSamplerWrapper``
        splits it (``job.SamplerShard``: the training one with its positions shuffled by
        (``data_seed``, epoch), as Lightning's; on one process it is kept). Kept as given: not a
        DataLoader, an iterable dataset, a ``batch_sampler`` of the user's own, or
        ``use_distributed_sampler=False``. Where Lightning differs, a warning says so
        (``_note_sampler_differences``). As Lightning: a loader with few workers for this machine
        warns (``worker_check``), and after ``seed_everything(workers=True)`` one without a
        ``worker_init_fn`` gets Lightning's worker seeding."""
        if isinstance(loader, DataLoader):
            _data.has_len_all_ranks(loader, self._strategy)  # Lightning's warnings: zero length, IterableDataset + len
            worker_check(loader, stage, self._strategy.world_size)
            add_worker_init_fn(loader, self._strategy.global_rank)  # seed_everything(workers=True)
        if loader is None or not isinstance(loader, DataLoader) or not self.use_distributed_sampler:
            return loader
        if not job.shardable(loader):  # an iterable dataset (Lightning keeps it too) or the user's batch_sampler
            self._note_own_batch_sampler(loader, stage)
            return loader
        builtin = isinstance(loader.sampler, (RandomSampler, SequentialSampler))
        n_samples = len(loader.dataset) if builtin else len_or_none(loader.sampler)
        self._note_sampler_differences(stage, isinstance(loader.sampler, RandomSampler), n_samples, builtin)
        every_process = self._strategy.world_size > 1 and getattr(self._strategy, "lightning_sampler", False)
        if self._strategy.data_parallel_world_size == 1 and isinstance(loader.sampler, SequentialSampler) \
                and not every_process:  # Lightning's strategy on several processes: its sampler even on one replica
            return loader  # one replica, in order: the user's loader itself, as Lightning (the same batches)
        return job.distributed_loader(loader, self._strategy, self.data_seed, custom_sampler_shuffle=stage == "fit",
                                      shuffle=True if stage == "fit" else None)  # Lightning shuffles every training one

    def _note_sampler_differences(self, stage: str, shuffle: bool, n_samples: int | None, builtin: bool) -> None:
        """Say (global rank 0) where this sampler differs from the one Lightning would inject,
        never silently: Lightning shuffles every distributed training sampler, keeps the loader's
        own (unsharded) sampler on one process, and splits predict data without repeating samples."""
        world = self._strategy.data_parallel_world_size
        if not self.is_global_zero:
            return
        if not builtin:
            if world > 1 and stage == "fit":
                log.info("the training DataLoader's own sampler is split over %d ranks as Lightning's "
                         "DistributedSamplerWrapper does (its indices' positions shuffled by seed %d and the epoch); "
                         "a run resumed mid-epoch continues exactly only if the sampler's order depends on "
                         "set_epoch alone", world, self.data_seed)
        elif stage == "fit" and not shuffle and world > 1:
            log.warning("the training DataLoader does not shuffle: its DistributedSampler shuffles anyway, as "
                        "Lightning's (seed %d, set_epoch each epoch). Pass use_distributed_sampler=False to keep "
                        "the loader's order", self.data_seed)
        elif stage == "fit" and shuffle and world == 1:
            log.info("one process: the shuffled training DataLoader's order comes from a DistributedSampler "
                     "(seed %d, epoch), so a resumed run continues it exactly; Lightning keeps the loader's "
                     "RandomSampler (global RNG) here", self.data_seed)
        elif stage != "fit" and shuffle:
            rank_zero_warn(f"the {stage} DataLoader shuffles: it is recommended that you turn shuffling off for "
                           "evaluation (as Lightning warns)", PossibleUserWarning)
        if stage == "predict" and world > 1 and n_samples and n_samples % world:
            log.warning("predict: %d samples on %d ranks: the DistributedSampler repeats %d sample(s) so every "
                        "rank runs the same number of forwards (sharded strategies gather collectively); "
                        "Lightning's predict sampler does not repeat them", n_samples, world,
                        world - n_samples % world)

    def _note_own_batch_sampler(self, loader: DataLoader, stage: str) -> None:
        """A ``batch_sampler`` of the user's own on several ranks: kept, every rank iterating all of
        it (Lightning re-creates it around a DistributedSampler). Said on global rank 0."""
        if job.own_batch_sampler(loader) and self._strategy.data_parallel_world_size > 1 and self.is_global_zero:
            log.warning("the %s DataLoader has its own batch_sampler (%s): zerotrain keeps it as given, so every "
                        "rank iterates all of its batches; Lightning re-creates it around a DistributedSampler. "
                        "Shard it yourself, or pass sampler= and batch_size= instead", stage,
                        type(loader.batch_sampler).__name__)

    # ------------------------------------------------------------------ fit's validation data
    _val_given: Any = None  # fit's val_dataloaders argument
    _val_pending = False  # not yet requested in this fit
    _val_loaded_epoch: float = -math.inf

    def _start_val_data(self, given: Any) -> None:
        """``fit`` begins: its validation loaders are requested when Lightning's validation loop
        requests them (``_fit_val_loaders``): first by the sanity check, when one runs (after
        ``on_sanity_check_start``, before the training loader, as Lightning), else at the start of
        training or the first validation."""
        self._val_given, self._val_pending, self._val_loaded_epoch = given, True, -math.inf
        self.val_dataloader = None

    def _val_data_defined(self) -> bool:
        """Lightning's validation data source is defined: loaders passed to ``fit``, or a
        ``val_dataloader`` of the datamodule or the module."""
        return self._val_given is not None or any(overrides_hook(owner, "val_dataloader")
                                                  for owner in (self.datamodule, self.module))

    def _require_train_loader(self) -> None:
        """``fit``'s training loader, requested once (Lightning requests it after the sanity check,
        before ``on_train_start``; ``estimated_stepping_batches`` or a resume may have asked first)."""
        if self.train_dataloader is None:
            self._load_train_loader()
        if self.train_dataloader is None:
            raise ConfigError("Trainer.fit: no training data (pass train_dataloaders or a datamodule, or "
                              "implement train_dataloader())")

    def _fit_val_loaders(self) -> Any:
        """``fit``'s validation loader(s), requested (from the datamodule or the module; loaders
        passed to ``fit`` are kept) the first time and again when ``reload_dataloaders_every_n_epochs``
        epochs passed since the last request, as Lightning: none when validation is off. A request
        by the sanity check in an epoch that does not validate does not count as the epoch's."""
        n = self.reload_dataloaders_every_n_epochs
        epoch = self.state.epoch
        due = self._val_pending or (bool(n) and self._val_given is None and epoch - self._val_loaded_epoch >= n)
        if not due:
            return self.val_dataloader
        if self.limit_val_batches == 0 or not self._validation_defined():  # Lightning asks for no data then
            self._val_pending = False
            return self.val_dataloader
        if n and not self._val_pending:
            log.info("epoch %d: reloading the validation dataloaders (reload_dataloaders_every_n_epochs=%d)", epoch, n)
        if not self.sanity_checking or self._validates_this_epoch():
            self._val_loaded_epoch = epoch
        self._val_pending = False
        self.val_dataloader = self._val_loaders(self._source("val_dataloader", self._val_given))
        return self.val_dataloader

    def _overfit(self, loader: Any, prefix: str = "train") -> Any:
        """``overfit_batches``: the same first batches every epoch, so the loader must not shuffle.
        As Lightning: a loader whose sampler is not a SequentialSampler gets one (over its dataset,
        same options), with Lightning's warning; with several ranks the injected DistributedSampler
        stays, unshuffled, so each rank keeps its share (Lightning's sequential sampler would give
        every rank all the data)."""
        if not self.overfit_batches or not isinstance(loader, DataLoader):
            return loader
        sampler = loader.sampler
        if isinstance(sampler, SequentialSampler) or job.own_batch_sampler(loader) or not hasattr(loader, "dataset"):
            return loader
        rank_zero_warn(f"You requested to overfit but enabled {prefix} dataloader shuffling. We are turning off the "
                       f"{prefix} dataloader shuffling for you.")
        if isinstance(sampler, (DistributedSampler, job.SamplerShard)) and self._strategy.data_parallel_world_size > 1:
            sampler.shuffle = False
            return loader
        return DataLoader(loader.dataset, sampler=SequentialSampler(loader.dataset), generator=loader.generator,
                          **job.loader_options(loader))

    def _limit(self, loader: Any, limit: int | float | None, prefix: str = "train") -> float:
        """The batches ``limit_<prefix>_batches`` leaves of ``loader`` (inf: no length, or a
        ``__len__`` raising NotImplementedError, as Lightning); a fraction other than 1.0 of a
        loader without a length is Lightning's MisconfigurationException."""
        if isinstance(loader, FitLoaders):  # several training loaders: each limited, then combined
            return loader.limited_len(lambda d: self._limit(d, limit, prefix))
        total = len_or_none(loader)
        total = math.inf if total is None else total
        if limit is None:
            return total
        if limit == 0:  # 0 or 0.0: this stage is off (Lightning's limit_*_batches=0)
            return 0
        if isinstance(limit, float) and limit <= 1.0:
            if total == math.inf and limit != 1.0:
                raise MisconfigurationException(
                    f"When using an `IterableDataset`, `Trainer(limit_{prefix}_batches)` must be `1.0` or an int. An "
                    f"int specifies `num_{prefix}_batches` to use. Trainer: limit_{prefix}_batches={limit!r} with a "
                    f"{type(loader).__name__} without a length")
            return max(1, int(total * limit)) if total != math.inf else math.inf
        return min(total, int(limit))

    def _val_check_batch(self, n_batches: float) -> float | None:
        """Lightning's ``val_check_batch``: validation after every this many training batches of
        the epoch (of the run with ``check_val_every_n_epoch=None``): an int ``val_check_interval``
        itself, a fraction that share of the epoch's batches (at least 1; 1.0 or None: the last
        batch, inf for a loader without a length); None when time-based (``_validation_due``)."""
        self.val_check_batch = batch = self._val_check_batch_of(n_batches)  # Lightning's trainer.val_check_batch
        return batch

    def _val_check_batch_of(self, n_batches: float) -> float | None:
        v = self.val_check_interval
        if self._val_check_time is not None:
            return None
        if isinstance(v, int) and not isinstance(v, bool):
            if v > n_batches and self.check_val_every_n_epoch is not None and self.limit_val_batches != 0:
                raise ConfigError(f"`val_check_interval` ({v}) must be less than or equal to the number of the "
                                  f"training batches ({n_batches}). Set limit_val_batches=0 to disable validation, or "
                                  "check_val_every_n_epoch=None to count the batches of the whole run")
            return v
        if n_batches == math.inf:
            if v is None or v == 1.0:
                return math.inf
            raise ConfigError(f"Trainer: val_check_interval={v!r} as a fraction needs a training loader with a length")
        return max(1, int(n_batches * (1.0 if v is None else v)))


def with_last(batches: Iterable, n_batches: float) -> Iterator[tuple[Any, bool]]:
    """Each batch with whether it is the epoch's last: by count where the epoch's length is known,
    else by fetching one batch ahead (as Lightning's prefetching fetcher does)."""
    if n_batches != math.inf:
        for i, batch in enumerate(batches):
            yield batch, i + 1 == n_batches
        return
    it = iter(batches)
    try:
        ahead = next(it)
    except StopIteration:
        return
    for batch in it:
        yield ahead, False
        ahead = batch
    yield ahead, True

def len_or_none(loader: Any) -> int | None:
    """``len(loader)``, None without one (no ``__len__``, or one raising NotImplementedError)."""
    return _data.sized_len(loader)


#: the stage a loader is prepared for -> Lightning's name of its hook
_HOOK_NAMES = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
               "predict": "predict_dataloader"}


def worker_check(loader: DataLoader, stage: str, local_world_size: int) -> None:
    """Lightning's hint about ``num_workers``: workers started by spawn without
    ``persistent_workers`` restart every epoch; fewer than the CPUs allow (``suggested_max_num_workers``,
    at most 2, or below 2) may leave the loop waiting for data (a PossibleUserWarning)."""
    import multiprocessing

    name = _HOOK_NAMES.get(stage, f"{stage}_dataloader")
    upper = _data.suggested_max_num_workers(max(1, local_world_size))
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method()
    if loader.num_workers > 0 and method == "spawn" and not loader.persistent_workers:
        rank_zero_warn(f"Consider setting `persistent_workers=True` in '{name}' to speed up the dataloader worker "
                       "initialization.")
    elif loader.num_workers <= 2 < upper or loader.num_workers < 2 <= upper:
        rank_zero_warn(f"The '{name}' does not have many workers which may be a bottleneck. Consider increasing the "
                       f"value of the `num_workers` argument` to `num_workers={upper}` in the `DataLoader` to improve "
                       "performance.", PossibleUserWarning)
