"""The Trainer's checkpoint protocol: what a save writes beside the tensors, and how a load
(resharding online) puts a run back where it was. The format itself is ``checkpoint_io.py``'s;
the tensor ranges are ``reshard.py``'s; this module decides what goes in and what comes out.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from .. import __version__
from . import checkpoint_io, elastic, reshard
from .errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger("zerotrain")


def save(trainer: "Trainer", path: str, update_latest: bool = True) -> None:
    """Collective: every rank writes its shard of the checkpoint directory ``path`` in parallel;
    rank 0 then publishes it atomically and points ``latest`` (beside it) at it
    (``trainer/checkpoint_io.py`` describes the format)."""
    s = trainer.strategy
    s.barrier()

    def describe() -> tuple[list, dict[str, Any]]:  # e.g. an optimizer state that is not per element
        entries, local = reshard.shard_entries(s.param_shards(), s.extra_state())
        local.update(rng=checkpoint_io.rng_state(), model=reshard.model_info_meta(s.checkpoint_model_info()),
                     optimizer=reshard.optimizer_meta(trainer.optimizer, s.optimizer_group_names()))
        return entries, local

    entries, local = reshard.agree(s, describe, catch=(ValueError, CheckpointError))
    with elastic.timeout_during(s, s.process_group_timeout_s):
        checkpoint_io.save(path, checkpoint_io.comm_of(s), entries, local, functools.partial(checkpoint_meta, trainer),
                           update_latest=update_latest)


def checkpoint_meta(trainer: "Trainer", locals_: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rank 0 at a save: everything but the tensors, from every rank's ``locals_``."""
    s, loader = trainer.strategy, trainer.train_dataloader
    meta = {"loop": trainer.state.state_dict(), "strategy": s.name,
            "precision": trainer.precision_plugin.name, "precision_state": trainer.precision_plugin.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
            "callbacks": trainer.hooks.state_dict(), "zerotrain_version": __version__,
            "data": {"batch_size": getattr(loader, "batch_size", None), "world": s.data_parallel_world_size,
                     "accumulate_grad_batches": trainer.accumulate_grad_batches}}
    if locals_ is not None:
        meta.update(reshard.layout_meta(locals_))
        meta["rng"] = [loc["rng"] for loc in locals_]
        meta["optimizer"] = dict(locals_[0]["optimizer"], names=reshard.merge_group_names(
            [loc["optimizer"]["names"] for loc in locals_]))
    trainer.hooks("on_save_checkpoint", trainer, trainer.module, meta)
    return meta


def resume_path(trainer: "Trainer", ckpt_path: str | None) -> str | None:
    """``"latest"``, and any start after an elastic restart, mean the ModelCheckpoint
    directory's newest checkpoint (nothing yet: start from ``ckpt_path``, or from scratch)."""
    if ckpt_path != "latest" and elastic.restart_count() == 0:
        return ckpt_path
    from ..callbacks.checkpoint import ModelCheckpoint

    dirs = [cb.dirpath for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    for d in dirs:
        if checkpoint_io.read_latest(d):
            log.info("resuming from the latest checkpoint in %s (restart %d)", d, elastic.restart_count())
            return d
    if ckpt_path == "latest" and not dirs:
        raise ConfigError("Trainer.fit: ckpt_path='latest' means the newest checkpoint of the "
                          "ModelCheckpoint directory, but this Trainer has no ModelCheckpoint "
                          "(enable_checkpointing=False?): pass a checkpoint directory instead")
    if ckpt_path == "latest":
        log.info("ckpt_path='latest': no checkpoint yet, starting from the beginning")
        return None
    return ckpt_path


def load(trainer: "Trainer", path: str) -> None:
    """Collective: load a checkpoint saved by any strategy on any world size (resharding
    online: each rank reads only the ranges it needs). Errors are raised on every rank."""
    s = trainer.strategy
    root, meta = reshard.agree(s, lambda: checkpoint_io.load_meta(path))
    saved_world = meta["world_size"]
    reshard.agree(s, lambda: checkpoint_io.verify(root, meta, range(s.global_rank, saved_world, s.world_size)))
    model = reshard.merge_model_info(reshard.all_gather(s, reshard.model_info_meta(s.checkpoint_model_info())))
    groups = reshard.merge_group_names(reshard.all_gather(s, s.optimizer_group_names()))
    optimizer = {"type": reshard.optimizer_meta(trainer.optimizer, [])["type"], "names": groups}
    reshard.agree(s, lambda: reshard.check_compatible(root, meta, model, optimizer))
    if (meta["strategy"], saved_world) != (s.name, s.world_size):
        log.info("resharding checkpoint %s: saved by %s on %d ranks, loading into %s on %d", root,
                 meta["strategy"], saved_world, s.name, s.world_size)
    with reshard.CheckpointReader(root, meta) as reader:
        s.load_param_shards(reader)
    if meta["precision"] == trainer.precision_plugin.name:
        trainer.precision_plugin.load_state_dict(meta["precision_state"])
    loop, note = reshard.resume_position(meta["loop"], meta.get("data"),
                                         getattr(trainer.train_dataloader, "batch_size", None),
                                         s.data_parallel_world_size)
    if note:
        log.warning("resume: %s", note)
    trainer.state.load_state_dict(loop)
    if trainer.lr_scheduler is not None and meta.get("scheduler") is not None:
        trainer.lr_scheduler.load_state_dict(meta["scheduler"])
    trainer.hooks.load_state_dict(meta.get("callbacks", {}))
    trainer.hooks("on_load_checkpoint", trainer, trainer.module, meta)
    if s.global_rank < len(meta["rng"]):
        checkpoint_io.set_rng_state(meta["rng"][s.global_rank])
    else:  # a rank the saved job did not have: a fresh stream of its own
        from .trainer import seed_everything

        seed_everything(trainer.seed + 1_000_003 * s.global_rank + trainer.state.global_step)
        log.warning("resume: rank %d has no saved RNG state (saved on %d ranks); re-seeded",
                    s.global_rank, saved_world)
    s.barrier()
