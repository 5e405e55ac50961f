"""The Trainer's checkpoint protocol: what a save writes beside the tensors, and how a load
(resharding online) puts a run back where it was. The format itself is ``checkpoint_io.py``'s;
the tensor ranges are ``reshard.py``'s; this module decides what goes in and what comes out.
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..version import __version__
from . import single_file as checkpoint_file, directory as checkpoint_io, reshard, url as url_checkpoint
from ..launch import elastic
from ..api import hparams
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigError
from ..loop.hooks import datamodule_hook

if TYPE_CHECKING:
    from ..loop.trainer import Trainer

log = logging.getLogger("zerotrain")


def save(trainer: "Trainer", path: str, update_latest: bool = True) -> None:
    """Collective: every rank writes its shard of the checkpoint directory ``path`` in parallel;
    rank 0 then publishes it atomically and points ``latest`` (beside it) at it
    (``trainer/checkpoint/directory.py`` describes the format)."""
    if trainer.module is None:
        raise AttributeError("Saving a checkpoint is only possible if a model is attached to the Trainer. Did you "
                             "call `Trainer.save_checkpoint()` before calling `Trainer.{fit,validate,test,predict}`?")
    loader = trainer.train_dataloader

    def loop_meta(meta: dict[str, Any]) -> None:  # rank 0: the Trainer's part, then the hook
        meta.update(loop=trainer.fit_loop.saved_position(), callbacks=trainer.hooks.state_dict(),
                    scheduler=trainer.optimization.scheduler_state(),
                    data={"batch_size": getattr(loader, "batch_size", None),
                          "world": trainer.strategy.data_parallel_world_size,
                          "accumulate_grad_batches": trainer.accumulate_grad_batches},
                    **hparams.checkpoint_entries(trainer.module, trainer.datamodule))
        # Lightning's key, as its hooks read it: every scheduler's state, in order
        meta["lr_schedulers"] = [c.scheduler.state_dict() for c in trainer.optimization.schedulers]
        dm = trainer.datamodule
        dm_state = datamodule_hook(trainer, dm, "state_dict") if dm is not None else None
        if dm_state:  # Lightning's key: the datamodule class's qualified name
            meta[type(dm).__qualname__] = dm_state
        trainer.hooks.both("on_save_checkpoint", trainer, trainer.module, meta)  # callbacks, then the module

    save_strategy(trainer.strategy, trainer.optimizer, path, loop_meta, update_latest)


def refuse_save_options(storage_options: Any) -> None:
    """``Trainer.save_checkpoint``'s ``storage_options``, refused as Lightning's TorchCheckpointIO refuses it."""
    if storage_options is not None:
        raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not "
                        "supported for `TorchCheckpointIO`. Please implement your custom `CheckpointIO` to define "
                        "how you'd like to use `storage_options`.")


def save_strategy(s: Any, optimizer: Any, path: str | os.PathLike, complete: Callable[[dict[str, Any]], None],
                  update_latest: bool = True) -> Path:
    """Collective: the strategy's part of a save (every rank's parameter shards, optimizer state,
    extras and RNG state, and the layout); rank 0 hands the metadata to ``complete`` to add the
    loop's part before it is written. Returns the checkpoint directory."""
    s.barrier()

    def describe() -> tuple[list, dict[str, Any]]:  # e.g. an optimizer state that is not per element
        entries, local = reshard.shard_entries(s.param_shards(), s.extra_state())
        local.update(rng=checkpoint_io.rng_state(), model=reshard.model_info_meta(s.checkpoint_model_info()),
                     optimizer=reshard.optimizer_meta(optimizer, s.optimizer_group_names()))
        return entries, local

    def meta(locals_: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"strategy": s.name, "precision": s.precision.name, "precision_state": s.precision.state_dict(),
               "zerotrain_version": __version__, **reshard.layout_meta(locals_),
               "rng": [loc["rng"] for loc in locals_],
               "optimizer": dict(locals_[0]["optimizer"], names=reshard.merge_group_names(
                   [loc["optimizer"]["names"] for loc in locals_]))}
        complete(out)
        return out

    entries, local = reshard.agree(s, describe, catch=(ValueError, CheckpointError))
    with elastic.timeout_during(s, s.process_group_timeout_s):
        return checkpoint_io.save(path, checkpoint_io.comm_of(s), entries, local, meta, update_latest=update_latest)


def resume_path(trainer: "Trainer", ckpt_path: str | None, fn: str = "fit", model_given: bool = True) -> str | None:
    """The checkpoint ``Trainer.<fn>(ckpt_path=...)`` means, or None for none, as Lightning's:

    * None: none; in ``validate``/``test``/``predict`` without a model, ``"best"`` (said in a warning);
      in ``fit`` with an OnExceptionCheckpoint, ``"last"`` (said too);
    * ``"best"``: the first ModelCheckpoint's ``best_model_path`` (a ValueError when there is none);
    * ``"last"``: the newest of the ModelCheckpoints' ``last`` checkpoints (``last.ckpt``,
      ``last-v1.ckpt``, ...), of the OnExceptionCheckpoints' files and of the checkpoints
      SIGTERM/SIGUSR1 saved there; none: a warning, and nothing is loaded;
    * ``"latest"`` (zerotrain's), or any start of ``fit`` after an elastic restart: the newest
      checkpoint of the ModelCheckpoint directory (its ``latest`` pointer, else its newest .ckpt);
    * anything else: that file or directory (a FileNotFoundError when it does not exist)."""
    if fn == "fit" and elastic.restart_count() > 0:
        ckpt_path = "latest"
    return parse_ckpt_path(trainer, fn, ckpt_path, model_given, trainer.module is not None)


def parse_ckpt_path(trainer: "Trainer", fn: str, ckpt_path: str | None, model_provided: bool,
                    model_connected: bool) -> str | None:
    """``resume_path``'s rules with Lightning's arguments (``_checkpoint_connector._parse_ckpt_path``)."""
    from ...callbacks.schedules import OnExceptionCheckpoint

    on_exception = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    if ckpt_path is None and on_exception and fn == "fit":
        ckpt_path = "last"
        warnings.warn(f"`.{fn}(ckpt_path=None)` was called without a model. The last model of the previous `fit` "
                      f"call will be used. You can pass `{fn}(ckpt_path='best')` to use the best model or "
                      f"`{fn}(ckpt_path='last')` to use the last model. If you pass a value, this warning will be "
                      "silenced.", stacklevel=3)
    if ckpt_path is None and model_provided:
        return None
    if ckpt_path is None and model_connected:
        ckpt_path = "best"
        also = (" There is also an on-exception checkpoint available, however it is used by default only when "
                "fitting." if on_exception else "")
        warnings.warn(f"`.{fn}(ckpt_path=None)` was called without a model. The best model of the previous `fit` "
                      f"call will be used.{also} You can pass `.{fn}(ckpt_path='best')` to use the best model or "
                      f"`.{fn}(ckpt_path='last')` to use the last model. If you pass a value, this warning will be "
                      "silenced.", stacklevel=3)
    if ckpt_path is None:
        return None
    if ckpt_path == "best":
        return _best_path(trainer, fn)
    if ckpt_path == "last":
        callbacks = _model_checkpoints(trainer)
        found = [cb.ckpt_path for cb in on_exception]
        found += [p for cb in callbacks for p in cb._find_last_checkpoints(trainer)]
        found += [str(p) for cb in callbacks if cb.dirpath and os.path.isdir(cb.dirpath)  # a signal's save
                  for p in Path(cb.dirpath).glob("sig*-step=*") if p.name.startswith(("sigterm-", "sigusr1-"))]
        found = [p for p in found if os.path.exists(p)]
        if not found:
            warnings.warn(f'.{fn}(ckpt_path="last") is set, but there is no last checkpoint available. No checkpoint '
                          "will be loaded. HINT: Set `ModelCheckpoint(..., save_last=True)`.", stacklevel=3)
            return None
        return max(found, key=lambda p: os.stat(p).st_mtime_ns)
    if url_checkpoint.is_url(ckpt_path):  # Lightning reads it through torch.hub: downloaded, then as a file
        return url_checkpoint.kept_copy(ckpt_path)
    if ckpt_path != "latest":
        if not _exists(ckpt_path):
            raise CheckpointNotFoundError(f"Checkpoint file not found: {ckpt_path}")
        return ckpt_path
    dirs = [cb.dirpath for cb in _model_checkpoints(trainer) if cb.dirpath]
    for d in dirs:
        if checkpoint_file.newest(d):
            log.info("Trainer.%s: the latest checkpoint in %s (restart %d)", fn, d, elastic.restart_count())
            return d
    if not dirs:
        raise ConfigError(f"Trainer.{fn}: ckpt_path='latest' means the newest checkpoint of the ModelCheckpoint "
                          "directory, but this Trainer has no ModelCheckpoint (enable_checkpointing=False?): pass a "
                          "checkpoint path instead")
    say = log.info if fn == "fit" else log.warning  # evaluating unloaded weights deserves a warning
    say("Trainer.%s: ckpt_path='latest': no checkpoint yet, %s", fn,
        "starting from the beginning" if fn == "fit" else "using the current weights")
    return None


def _exists(path: str | os.PathLike) -> bool:
    """Something ``checkpoint_io.resolve`` could read is there: the path, its ``.old`` (a save
    killed between its renames) or, for ``DIR/latest`` / ``DIR/last``, the folder."""
    p = Path(path)
    return p.exists() or p.with_name(p.name + ".old").exists() or (
        p.name in (checkpoint_io.LATEST, "last") and p.parent.is_dir())


def _model_checkpoints(trainer: "Trainer") -> list:
    from ...callbacks.checkpoint import ModelCheckpoint

    return [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]


def _best_path(trainer: "Trainer", fn: str) -> str:
    """Lightning's ``ckpt_path="best"``: the first ModelCheckpoint's best checkpoint, with its
    warning when there are several and its ValueErrors when there is none."""
    callbacks = _model_checkpoints(trainer)
    if len(callbacks) > 1:
        warnings.warn(f'`.{fn}(ckpt_path="best")` is called with Trainer configured with multiple `ModelCheckpoint` '
                      "callbacks. It will use the best checkpoint path from first checkpoint callback.", stacklevel=4)
    if not callbacks:
        raise ValueError(f'`.{fn}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured.')
    best = callbacks[0].best_model_path
    if not best:
        if trainer.fast_dev_run:
            raise ValueError(f'You cannot execute `.{fn}(ckpt_path="best")` with `fast_dev_run=True`. Please pass an '
                             f"exact checkpoint path to `.{fn}(ckpt_path=...)`")
        raise ValueError(f'`.{fn}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save the best '
                         "model.")
    return best


def load(trainer: "Trainer", path: str) -> None:
    """Collective: load a checkpoint saved by any strategy on any world size (resharding
    online: each rank reads only the ranges it needs). Errors are raised on every rank."""
    s = trainer.strategy
    meta = load_strategy(s, trainer.optimizer, path)
    loop, note = reshard.resume_position(meta["loop"], meta.get("data"),
                                         getattr(trainer.train_dataloader, "batch_size", None),
                                         s.data_parallel_world_size)
    if note:
        log.warning("resume: %s", note)
    trainer.state.load_state_dict(loop)
    dm = trainer.datamodule
    if dm is not None and type(dm).__qualname__ in meta:  # before the module's hook, as Lightning
        datamodule_hook(trainer, dm, "load_state_dict", meta[type(dm).__qualname__])
    trainer.hooks.load_state_dict(meta.get("callbacks", {}))
    trainer.module.on_load_checkpoint(meta)  # Lightning's order: the module, then the callbacks
    trainer.hooks("on_load_checkpoint", trainer, trainer.module, meta)
    # the schedulers after the callbacks, as Lightning's training state: a callback may have
    # swapped them (StochasticWeightAveraging restores its own SWALR)
    trainer.optimization.load_scheduler_state(meta.get("scheduler"))
    restore_or_reseed(s, meta["rng"], path, trainer.seed, trainer.state.global_step)
    s.barrier()


def restore_or_reseed(s: Any, states: list, path: str | os.PathLike, seed: int | None, step: int) -> None:
    """Collective, the Trainer's and the Engine's resume alike: this rank's saved generator states;
    a rank the saved job did not have (the job grew) gets a fresh stream of its own, the same on
    every resume: seeded from the sampler seed (``seed``, else ``seed_everything``'s, else 0), its
    global rank and the saved step."""
    if not restore_rng(s, states, path):
        from ..utilities import sampler_seed, seed_rngs

        seed_rngs(sampler_seed(seed) + 1_000_003 * s.global_rank + step)
        log.warning("resume: rank %d has no saved RNG state (saved on %d ranks); re-seeded", s.global_rank,
                    len(states))


def restore_rng(s: Any, states: list, path: str | os.PathLike) -> bool:
    """Collective: this rank's saved generator states, restored on every rank together; False
    where the saved job had no such rank. A state that cannot be restored (a malformed RNG state
    in meta.pt) is a CheckpointError on every rank at once, naming the rank and the cause; else
    the others would wait for that rank in their next collective until its timeout."""
    def restore() -> bool:
        if s.global_rank >= len(states):
            return False
        try:
            checkpoint_io.set_rng_state(states[s.global_rank])
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint {path}: {checkpoint_io.META}: rank {s.global_rank}'s saved RNG "
                                  f"state cannot be restored ({type(exc).__name__}: {exc})") from exc
        return True

    return reshard.agree(s, restore)


def load_strategy(s: Any, optimizer: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Collective: the strategy's part of a load: check the files and that the checkpoint fits
    this model and optimizer (on every rank together), fill this rank's parameters, optimizer
    state and extras through a :class:`~.reshard.CheckpointReader`, and the precision state.
    Returns the checkpoint's metadata for the loop's part."""
    root, meta = reshard.agree(s, lambda: checkpoint_io.load_meta(path))
    saved_world = meta["world_size"]
    reshard.agree(s, lambda: checkpoint_io.verify(root, meta, range(s.global_rank, saved_world, s.world_size)))
    model = reshard.merge_model_info(reshard.all_gather(s, reshard.model_info_meta(s.checkpoint_model_info())))
    groups = reshard.merge_group_names(reshard.all_gather(s, s.optimizer_group_names()))
    kind = {"type": reshard.optimizer_meta(optimizer, [])["type"], "names": groups}
    reshard.agree(s, lambda: reshard.check_compatible(root, meta, model, kind))
    if (meta["strategy"], saved_world) != (s.name, s.world_size):
        log.info("resharding checkpoint %s: saved by %s on %d ranks, loading into %s on %d", root,
                 meta["strategy"], saved_world, s.name, s.world_size)
    with reshard.CheckpointReader(root, meta) as reader:
        s.load_param_shards(reader)
    if meta["precision"] == s.precision.name:
        s.precision.load_state_dict(meta["precision_state"])
    return meta
