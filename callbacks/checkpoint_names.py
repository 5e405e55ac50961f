"""ModelCheckpoint's file-system side: the names it gives checkpoints (Lightning's templates),
where it saves without a ``dirpath``, finding ``last`` checkpoints, the ``save_last="link"``
link, and removing a checkpoint it no longer keeps (``callbacks/checkpoint.py`` decides when)."""
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


def fill_template(template: str, metrics: dict[str, Any], auto_insert_metric_name: bool, equals: str = "=") -> str:
    """``template`` with each ``{name}`` / ``{name:spec}`` replaced by ``metrics[name]`` formatted
    by ``spec`` (written ``name=value`` with ``auto_insert_metric_name``). A name missing from
    ``metrics`` is added to it as ``tensor(0)`` (Lightning's), so names may hold dots or slashes."""
    def one(m: re.Match) -> str:
        name, spec = m.group(1), (m.group(2) or ":")[1:]
        if name not in metrics:
            metrics[name] = torch.tensor(0)
        return (f"{name}{equals}" if auto_insert_metric_name else "") + format(metrics[name], spec)

    return _FIELD.sub(one, template)


def default_dirpath(trainer: Any) -> str:
    """Lightning's checkpoint folder when none is given: ``<save_dir>/<name>/<version>/checkpoints``
    of the first logger (``version_<n>`` for a number), else ``default_root_dir/checkpoints``."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "checkpoints")
    first = trainer.loggers[0]
    save_dir = first.save_dir if first.save_dir is not None else trainer.default_root_dir
    version = first.version if isinstance(first.version, str) else f"version_{first.version}"
    return os.path.join(save_dir, str(first.name), version, "checkpoints")


def is_local(path: Any) -> bool:
    """A path on this machine's file system (no ``protocol://``)."""
    return "://" not in str(path) or str(path).startswith("file://")


def last_checkpoints(directory: Any, last_name: str, extension: str) -> set[str]:
    """The ``last`` checkpoints in ``directory`` (``last.ckpt``, ``last-v1.ckpt``, ...; a
    version written as ``last-<digits>``) as normalized paths; none when it does not exist."""
    pattern = re.compile(rf"^{re.escape(last_name)}(-(\d+))?")
    try:
        entries = list(Path(directory).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return set()
    return {os.path.normpath(str(p)) for p in entries if p.suffix == extension and pattern.match(p.stem)}


def link(trainer: Any, target: str, linkpath: str) -> None:
    """Collective: ``linkpath`` becomes a relative symbolic link to ``target`` (a copy where links
    cannot be made), replacing whatever was there; written by global rank 0, then every rank goes on."""
    if trainer.is_global_zero and os.path.abspath(target) != os.path.abspath(linkpath):
        remove(linkpath)
        try:
            os.symlink(os.path.relpath(target, os.path.dirname(linkpath)), linkpath)
        except OSError:
            (shutil.copytree if os.path.isdir(target) else shutil.copy)(target, linkpath)
    trainer.strategy.barrier()


def remove(path: str) -> None:
    """A checkpoint directory, or a file (or a link to either: the link only)."""
    if os.path.islink(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def should_remove(trainer: Any, dirpath: Any, previous: str, current: str) -> bool:
    """Lightning's rule for deleting a checkpoint this callback no longer keeps: never the one just
    written, nor (on this machine) one outside ``dirpath`` or the one this fit resumed from."""
    if previous == current:
        return False
    if not is_local(previous):
        return True
    old = Path(previous).absolute()
    resumed = getattr(trainer, "ckpt_path", None)
    if resumed is not None and old == Path(resumed).absolute():
        return False
    return Path(dirpath).absolute() in old.parents


def epoch_end_by_default(trainer: Any) -> bool:
    """Lightning's ``save_on_train_epoch_end=None``: at the end of the training epoch, unless
    validation runs every n-th epoch only (``check_val_every_n_epoch != 1``) or within the epoch
    (``val_check_interval`` other than a whole epoch): then after validation."""
    if getattr(trainer, "check_val_every_n_epoch", 1) != 1:
        return False
    if getattr(trainer, "val_dataloader", None) is None or getattr(trainer, "limit_val_batches", None) == 0:
        return True
    return getattr(trainer, "val_check_interval", None) in (None, 1.0)
