"""ModelCheckpoint: periodic and best-k checkpoints, each written atomically, and a ``latest``
pointer to the newest. (No ``from __future__ import annotations``: the CLI builds its arguments from
this signature's real types.)"""
import logging
import math
import os
import re
import shutil
from typing import Any

import torch

from ..trainer.checkpoint_file import newest
from ..trainer.errors import CheckpointError, ConfigError
from .base import Callback

log = logging.getLogger("zerotrain")


class ModelCheckpoint(Callback):
    """Save every ``every_n_train_steps`` optimizer steps (and at the end of fit if ``save_last``).

    Each save is a new checkpoint ``dirpath/filename.ckpt``, written atomically: one Lightning-style
    file for unsharded state (``trainer/checkpoint_file.py``), a sharded directory (with the
    pointer ``dirpath/latest`` moved to it) otherwise (``trainer/checkpoint_io.py``). Resume with
    ``fit(ckpt_path="latest")`` (or ``ckpt_path=dirpath``: its newest); a worker restarted by the
    elastic agent does so by itself.

    With ``monitor`` set, the ``save_top_k`` best checkpoints by that metric (``mode`` "min" or
    "max"; ``save_top_k=-1`` keeps all) are kept, and so is the one ``latest`` points to (the
    newest, which a restart needs) even when it is not among the best: it is deleted once a newer
    one replaces it. Without ``monitor`` every checkpoint is kept. Saving is a collective: the
    callback runs on every rank.

    Lightning's arguments, in Lightning's order: ``verbose`` (one line per save),
    ``auto_insert_metric_name``, ``save_on_train_epoch_end`` (None: Lightning's rule,
    ``_epoch_end_by_default``) and ``enable_version_counter`` (a name already taken gets
    ``-v1``, ``-v2``, ...) work as Lightning's; so do ``save_on_exception`` (a checkpoint when an
    exception ends fit after a step was taken since the last save) and ``save_last="link"``
    (``dirpath/last.ckpt``, a relative symbolic link to the newest checkpoint, moved at every
    save). ``train_time_interval`` is refused (``_refuse`` says why). Where this callback differs
    from Lightning's, ``_note_differences`` says so once at the start of fit.
    """

    #: the Trainer's own (``enable_checkpointing=True`` without one given): its differences are info only
    made_by_trainer = False
    #: Lightning's name of the ``save_last="link"`` link (``.safetensors`` with ``save_weights_only``)
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | None = None, filename: str | None = "step={step:06d}",
                 monitor: str | None = None, verbose: bool = False, save_last: bool | str | None = True,
                 save_top_k: int = 1, save_on_exception: bool = False, save_weights_only: bool = False,
                 mode: str = "min", auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: Any = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True) -> None:
        filename = "step={step:06d}" if filename is None else filename
        if mode not in ("min", "max"):  # Lightning's messages, ConfigError being its MisconfigurationException
            raise ConfigError(f"`mode` can be min, max but got {mode}")
        if save_top_k < -1:
            raise ConfigError(f"Invalid value for save_top_k={save_top_k}. Must be >= -1")
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 0:
                raise ConfigError(f"Invalid value for {name}={value}. Must be >= 0")
        if sum(bool(v) for v in (every_n_train_steps, every_n_epochs, train_time_interval)) > 1:
            raise ConfigError(f"Combination of parameters every_n_train_steps={every_n_train_steps or 0}, "
                              f"every_n_epochs={every_n_epochs or 0} and train_time_interval={train_time_interval} "
                              "should be mutually exclusive.")
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise ConfigError(f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration. "
                              "No quantity for top_k to track.")
        if "/" in filename or filename in ("latest", "last", "last.ckpt"):
            raise ConfigError(f"ModelCheckpoint: filename={filename!r} must be one directory name, not "
                              "'latest', 'last' or 'last.ckpt'")
        _refuse("train_time_interval", train_time_interval, None,
                "saving by wall-clock time is not implemented; valid: every_n_train_steps, or a Timer callback "
                "(it stops fit, and save_last then saves)")
        if save_last not in (True, False, None, "link"):
            raise ConfigError(f"ModelCheckpoint: save_last={save_last!r}; valid choices: True, False, None, 'link'")
        if monitor is not None and every_n_train_steps is None and every_n_epochs is None:
            every_n_epochs = 1  # Lightning's trigger for a monitored checkpoint given none
        if isinstance(dirpath, (str, os.PathLike)):
            dirpath = os.path.expanduser(dirpath)  # Lightning's: ~ is the home folder
        self.dirpath, self.every_n_train_steps = dirpath, every_n_train_steps or None  # 0: never, as None
        self.save_last = save_last if save_last == "link" else bool(save_last)
        self.save_on_exception = save_on_exception
        self.monitor, self.mode, self.save_top_k, self.filename = monitor, mode, save_top_k, filename
        self.every_n_epochs, self.save_weights_only = every_n_epochs, save_weights_only
        self.auto_insert_metric_name, self.verbose = auto_insert_metric_name, verbose
        self.save_on_train_epoch_end, self.enable_version_counter = save_on_train_epoch_end, enable_version_counter
        self.best_k: dict[str, float] = {}  # path -> score, for the checkpoints this callback keeps
        self.last_path: str | None = None
        self._last_saved_step = -1
        self._epoch = 0
        self._stage: str | None = None
        self._at_epoch_end: bool | None = None  # save_on_train_epoch_end, resolved at on_train_start
        self._noted = False
        self._said_missing = False  # the monitored metric was not logged yet: warned once
        self.current_score: Any = None  # the monitored value at the last save, a tensor (NaN: the worst)

    @property
    def state_key(self) -> str:
        """Lightning's key of this callback's state in a checkpoint's ``callbacks``."""
        triggers = {"monitor": self.monitor, "mode": self.mode, "every_n_train_steps": self.every_n_train_steps or 0,
                    "every_n_epochs": self.every_n_epochs or 0, "train_time_interval": None}
        return f"{type(self).__qualname__}{triggers}"

    @property
    def best_model_path(self) -> str | None:
        """The best kept checkpoint by ``monitor``; without ``monitor``, the newest save (Lightning's)."""
        if self.monitor is None:
            return self.last_path
        scored = {p: s for p, s in self.best_k.items() if not math.isnan(s)}
        if not scored:
            return None
        pick = min if self.mode == "min" else max
        return pick(scored, key=scored.get)

    @property
    def best_k_models(self) -> dict[str, float]:
        """Lightning's name: path -> monitored score of each checkpoint kept."""
        return self.best_k

    @property
    def best_model_score(self) -> float | None:
        best = self.best_model_path
        return self.best_k.get(best) if best is not None else None  # without monitor: None

    @property
    def kth_best_model_path(self) -> str | None:
        """The worst of the kept ``save_top_k`` (the next to go)."""
        kept = [p for p in self.best_k if p in self._keep() and not math.isnan(self.best_k[p])]
        if not kept:
            return None
        return (max if self.mode == "min" else min)(kept, key=self.best_k.get)

    @property
    def last_model_path(self) -> str | None:
        """The newest checkpoint (with ``save_last="link"``: the ``last.ckpt`` link to it)."""
        if self.save_last == "link" and self.last_path is not None:
            return self._link_path()
        return self.last_path

    @property
    def latest_path(self) -> str | None:
        """The newest checkpoint in ``dirpath`` (its ``latest`` pointer, else its newest .ckpt file), or None."""
        latest = newest(self.dirpath) if self.dirpath else None
        return str(latest) if latest is not None else None

    def setup(self, trainer, pl_module, stage: str | None = None) -> None:
        if self.dirpath is None:  # Lightning's rule; rank 0 decides (a new logger version is picked there)
            self.dirpath = trainer.strategy.broadcast(_default_dirpath(trainer))
        self._stage = stage  # validation ends save during fit only, as Lightning's

    def on_train_start(self, trainer, pl_module) -> None:
        given = self.save_on_train_epoch_end
        self._at_epoch_end = _epoch_end_by_default(trainer) if given is None else bool(given)
        if not self._noted and trainer.is_global_zero:
            self._noted = True
            self._note_differences()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        if n and step > 0 and step % n == 0 and step != self._last_saved_step:
            self._save(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._epoch = trainer.current_epoch  # the epoch that on_train_epoch_end ends

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._at_epoch_end:
            self._save_for_epoch(trainer, self._epoch)

    def on_validation_end(self, trainer, pl_module) -> None:
        """``save_on_train_epoch_end=False``: the epoch trigger is checked after each validation of fit."""
        if self._at_epoch_end is False and self._stage == "fit" and not trainer.sanity_checking:
            self._save_for_epoch(trainer, trainer.current_epoch)

    def _save_for_epoch(self, trainer, epoch: int) -> None:
        n = self.every_n_epochs
        if n and (epoch + 1) % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        """``save_last``: a checkpoint of the final state, unless this step was saved; with
        ``"link"`` (as Lightning's) only when none was saved in this fit: the link names the newest."""
        linked = self.save_last == "link" and self._last_saved_step >= 0
        if self.save_last and trainer.global_step != self._last_saved_step and not linked:
            self._save(trainer, last=True)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """``save_on_exception``: a checkpoint of the state the exception left, when a step was
        taken since the last save (not in the sanity check; not after SIGTERM/SIGUSR1, which saved
        already). Saving is a collective: every rank must be here (an exception on one rank only
        leaves this rank waiting until the watchdog ends the job). A failed save is logged and the
        original exception goes on."""
        from ..trainer.signals import SIGTERMException

        if not self.save_on_exception or isinstance(exception, SIGTERMException) or trainer.sanity_checking \
                or trainer.global_step in (0, self._last_saved_step) or self.dirpath is None:
            return
        try:
            path = self._save(trainer, last=True)
        except Exception as exc:  # noqa: BLE001 - the exception that ended fit is the one to raise
            log.error("ModelCheckpoint(save_on_exception=True): saving failed: %r", exc)
            return
        if trainer.is_global_zero:
            log.info("An %s was raised with message: %s, saved checkpoint to %s", type(exception).__name__,
                     exception, path)

    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None,
                               prefix: str | None = None, *, epoch: int | None = None, step: int | None = None) -> str:
        """``filename`` (default: this callback's) filled in, as Lightning's: its templates
        (``"{epoch}-{val_loss:.2f}"`` gives ``epoch=3-val_loss=0.12`` with
        ``auto_insert_metric_name``; a name already written before its brace, as in
        ``"step={step:06d}"``, is not written twice) and Python format specs; a value not in
        ``metrics`` (nor given as ``epoch``/``step``) reads 0. ``prefix`` goes first, ``-v{ver}``
        last, then ``.ckpt`` (``.safetensors`` for weights only), inside ``dirpath`` when set."""
        values = {**metrics, **({"epoch": epoch} if epoch is not None else {}),
                  **({"step": step} if step is not None else {})}

        def fill(m: re.Match) -> str:
            name, spec = m.group(1), m.group(2) or ""
            prefix_ = f"{name}=" if self.auto_insert_metric_name and not m.string[:m.start()].endswith(
                f"{name}=") else ""
            return prefix_ + format(values.get(name, 0), spec[1:])

        name = re.sub(r"\{([^{}:]+)(:[^{}]*)?\}", fill, filename or self.filename)
        name = f"{prefix}-{name}" if prefix else name
        name = f"{name}-v{ver}" if ver is not None else name
        name += self._extension()
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def _extension(self) -> str:
        return ".safetensors" if self.save_weights_only else self.FILE_EXTENSION

    def _save(self, trainer, last: bool = False) -> str | None:
        """Save a checkpoint (``last``: the end of fit or an exception, which save whether or not the
        monitored metric was logged, unranked then); returns its path, None when it waits for it."""
        metrics = self._monitor_candidates(trainer)
        score = metrics.get(self.monitor) if self.monitor is not None else None
        if self.monitor is not None and score is None and not last and not self._monitor_missing(trainer):
            return None
        self._last_saved_step = trainer.global_step
        path = os.path.join(self.dirpath, os.path.basename(self.format_checkpoint_name(metrics)))
        if self.enable_version_counter:
            path = self._unused_name(trainer, path)
        if score is not None:  # before saving: the checkpoint's own state lists it
            score = score.detach().cpu() if isinstance(score, torch.Tensor) else torch.tensor(float(score))
            if torch.isnan(score):  # Lightning's: NaN ranks as the worst
                score = torch.tensor(math.inf if self.mode == "min" else -math.inf)
            self.current_score = score  # a tensor, as Lightning's
            self.best_k[path] = float(score)
        try:
            if self.save_weights_only:
                self._save_weights(trainer, path)
            else:
                trainer.save_checkpoint(path)
        except CheckpointError as exc:  # name the setting that chose the path
            raise CheckpointError(f"{exc} (ModelCheckpoint dirpath={self.dirpath!r})") from exc
        self.last_path = path
        self._prune(trainer)
        if self.save_last == "link":
            self._link(trainer, path)
        if self.verbose and trainer.is_global_zero:
            self._say_saved(trainer, path)
        return path

    def _monitor_candidates(self, trainer) -> dict[str, Any]:
        """What ``monitor`` and ``filename`` may name, as Lightning's: the logged metrics, with
        ``epoch`` and ``step`` (the current counters) where not logged."""
        return {**trainer.callback_metrics, "epoch": trainer.callback_metrics.get("epoch", trainer.current_epoch),
                "step": trainer.callback_metrics.get("step", trainer.global_step)}

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Lightning's: write ``best_k_models`` (path -> score) to ``filepath`` (default
        ``dirpath/best_k_models.yaml``)."""
        import yaml

        filepath = filepath if filepath is not None else os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as f:
            yaml.dump({k: float(v) for k, v in self.best_k_models.items()}, f)

    def _monitor_missing(self, trainer) -> bool:
        """The monitored metric is not logged (yet): as Lightning, an error once a validation of
        this fit has run (it should have logged it by then), else a warning and no save until it is."""
        keys = list(trainer.callback_metrics) + [k for k in ("epoch", "step") if k not in trainer.callback_metrics]
        message = (f"`ModelCheckpoint(monitor={self.monitor!r})` could not find the monitored key in the returned "
                   f"metrics: {keys}. HINT: Did you call `log({self.monitor!r}, value)` "
                   "in the `LightningModule`?")
        if getattr(trainer, "_last_val_step", -1) >= 0:
            raise ConfigError(message)
        if not self._said_missing and trainer.is_global_zero:
            self._said_missing = True
            import warnings

            warnings.warn(message, stacklevel=2)
        return False

    def _link_path(self) -> str:
        return os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self._extension())

    def _link(self, trainer, target: str) -> None:
        """``save_last="link"``: ``dirpath/last.ckpt`` becomes a relative symbolic link to ``target``
        (a copy where links cannot be made), written by global rank 0, then every rank goes on."""
        link = self._link_path()
        if trainer.is_global_zero and os.path.abspath(link) != os.path.abspath(target):
            _remove(link)
            try:
                os.symlink(os.path.relpath(target, os.path.dirname(link)), link)
            except OSError:
                (shutil.copytree if os.path.isdir(target) else shutil.copy)(target, link)
        trainer.strategy.barrier()

    def _unused_name(self, trainer, path: str) -> str:
        """Lightning's version counter: ``NAME-v1``, ``NAME-v2``, ... while ``path`` is taken (a
        collective: every rank must pick the same name, so any rank seeing it taken counts)."""
        ext = self._extension()
        stem, candidate, version = path[:len(path) - len(ext)], path, 1
        while trainer.strategy.any_rank(os.path.exists(candidate)):
            candidate, version = f"{stem}-v{version}{ext}", version + 1
        return candidate

    def _say_saved(self, trainer, path: str) -> None:
        """``verbose``: one line per save, as Lightning's (rank 0)."""
        where = f"Epoch {trainer.current_epoch:d}, global step {trainer.global_step:d}"
        if self.monitor is None:
            log.info("%s: saving model to %r", where, path)
        elif path in self._keep():
            k = len(self.best_k) if self.save_top_k == -1 else self.save_top_k
            log.info("%s: %r reached %0.5f (best %0.5f), saving model to %r as top %d", where, self.monitor,
                     self.best_k[path], self.best_model_score, path, k)
        else:
            log.info("%s: %r was not in top %d (saved to %r as the newest checkpoint, deleted when a newer one "
                     "replaces it)", where, self.monitor, self.save_top_k, path)

    def _note_differences(self) -> None:
        """Say once, at the start of the first fit (global rank 0), where this callback saves
        differently from Lightning's with the same arguments."""
        notes = ["a checkpoint is " + ("one consolidated .safetensors file of the weights, not a .ckpt file"
                                       if self.save_weights_only else "a folder NAME.ckpt (one shard file per "
                                       "rank) under a sharded strategy, as Lightning's DeepSpeed strategy")]
        if self.save_last:
            notes.append("save_last saves once at the end of fit (default True here; Lightning's None saves no "
                         "last.ckpt), and dirpath/latest always names the newest checkpoint")
        if self.monitor is None:
            notes.append("without monitor every checkpoint is kept (Lightning keeps the newest only)")
        else:
            notes.append("the newest checkpoint is kept until the next save even when it is not in the top "
                         f"{self.save_top_k}")
        periodic = self.every_n_train_steps or self.every_n_epochs
        if not periodic:
            notes.append("with no monitor and no every_n_train_steps/every_n_epochs nothing is saved during "
                         "training (Lightning saves every epoch)")
        say = log.warning if not periodic and not self.made_by_trainer else log.info
        say("ModelCheckpoint(dirpath=%r) differs from Lightning's: %s", self.dirpath, "; ".join(notes))

    def _save_weights(self, trainer, path: str) -> None:
        """Weights only, as one consolidated safetensors file (every key of the module's state
        dict at full shape, loadable by plain PyTorch): the sharded checkpoint is written to a
        scratch directory by every rank, consolidated by rank 0 one tensor at a time
        (``trainer/consolidate.py``), then removed. Not a resume point: ``latest`` does not move."""
        from ..trainer.consolidate import consolidate

        scratch = os.path.join(self.dirpath, f".{os.path.basename(path)}.shards")
        trainer.save_checkpoint(scratch, update_latest=False)
        error = None
        try:
            if trainer.is_global_zero:
                try:
                    consolidate(scratch, path)
                except CheckpointError as exc:  # raised on every rank below, not on rank 0 alone
                    error = f"rank 0: {exc}"
                except Exception as exc:  # noqa: BLE001 - the same: no rank may be left waiting below
                    error = f"rank 0: {exc!r}"
        finally:
            if trainer.is_global_zero:
                shutil.rmtree(scratch, ignore_errors=True)
        error = trainer.strategy.broadcast(error)
        if error:
            raise CheckpointError(f"saving weights {path!r} failed: {error}")

    def _keep(self) -> set[str]:
        if self.save_top_k == -1:
            return set(self.best_k)
        scored = [p for p in self.best_k if not math.isnan(self.best_k[p])]
        scored.sort(key=self.best_k.get, reverse=self.mode == "max")
        return set(scored[:self.save_top_k])

    def _prune(self, trainer) -> None:
        if self.monitor is None:
            return
        latest = os.path.abspath(self.latest_path or self.last_path or "")
        for path in sorted(set(self.best_k) - self._keep()):
            if os.path.abspath(path) == latest:
                continue  # never the one a restart would resume from
            del self.best_k[path]
            if trainer.is_global_zero:
                _remove(path)
        trainer.strategy.barrier()

    def state_dict(self) -> dict[str, Any]:
        """Lightning's keys (scores as floats), and this callback's own (``best_k``, ``last_path``)."""
        return {"monitor": self.monitor, "best_model_score": self.best_model_score,
                "best_model_path": self.best_model_path or "", "current_score": self.current_score,
                "dirpath": None if self.dirpath is None else str(self.dirpath), "best_k_models": dict(self.best_k),
                "kth_best_model_path": self.kth_best_model_path or "", "last_model_path": self.last_model_path or "",
                "best_k": dict(self.best_k), "last_path": self.last_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.last_path = state.get("last_path")
        self.current_score = state.get("current_score")


def _default_dirpath(trainer) -> str:
    """Lightning's checkpoint folder when none is given: ``<save_dir>/<name>/<version>/checkpoints``
    of the first logger (``version_<n>`` for a number), else ``default_root_dir/checkpoints``."""
    if not trainer.loggers:
        return os.path.join(trainer.default_root_dir, "checkpoints")
    first = trainer.loggers[0]
    save_dir = first.save_dir if first.save_dir is not None else trainer.default_root_dir
    version = first.version if isinstance(first.version, str) else f"version_{first.version}"
    return os.path.join(save_dir, str(first.name), version, "checkpoints")


def _epoch_end_by_default(trainer) -> bool:
    """Lightning's ``save_on_train_epoch_end=None``: at the end of the training epoch, unless
    validation runs every n-th epoch only (``check_val_every_n_epoch != 1``) or within the epoch
    (``val_check_interval`` other than a whole epoch): then after validation."""
    if getattr(trainer, "check_val_every_n_epoch", 1) != 1:
        return False
    if getattr(trainer, "val_dataloader", None) is None or getattr(trainer, "limit_val_batches", None) == 0:
        return True
    return getattr(trainer, "val_check_interval", None) in (None, 1.0)


def _refuse(name: str, value: Any, default: Any, why: str) -> None:
    """A Lightning argument this callback does not implement: only its default is accepted."""
    if value != default:
        raise ConfigError(f"ModelCheckpoint: {name}={value!r} is not supported: {why}")


def _remove(path: str) -> None:
    """A checkpoint directory, or a weights-only file (or a link to either: the link only)."""
    if os.path.islink(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
