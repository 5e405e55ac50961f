"""Callback and Logger bases. Every hook is a no-op; callbacks override what they observe.
Lightning's callback hooks and signatures (``trainer/loop/hooks.py`` lists them; the module's own
hook runs after the callbacks')."""
from __future__ import annotations

import os
from typing import Any


class Callback:
    @property
    def state_key(self) -> str:
        return type(self).__qualname__

    def setup(self, trainer, pl_module, stage: str) -> None: ...
    def on_fit_start(self, trainer, pl_module) -> None: ...
    def on_fit_end(self, trainer, pl_module) -> None: ...
    def on_train_start(self, trainer, pl_module) -> None: ...
    def on_train_end(self, trainer, pl_module) -> None: ...
    def on_train_epoch_start(self, trainer, pl_module) -> None: ...
    def on_train_epoch_end(self, trainer, pl_module) -> None: ...
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, trainer, pl_module, loss) -> None: ...
    def on_after_backward(self, trainer, pl_module) -> None: ...
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None: ...
    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None: ...
    def on_validation_start(self, trainer, pl_module) -> None: ...
    def on_validation_end(self, trainer, pl_module) -> None: ...
    def on_validation_epoch_start(self, trainer, pl_module) -> None: ...
    def on_validation_epoch_end(self, trainer, pl_module) -> None: ...
    def on_validation_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None: ...
    # on_test_* and on_predict_*: the validation hooks' no-ops under their names (``stage_hooks``)
    def on_sanity_check_start(self, trainer, pl_module) -> None: ...
    def on_sanity_check_end(self, trainer, pl_module) -> None: ...
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None: ...
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None: ...
    def teardown(self, trainer, pl_module, stage: str) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def __getattr__(self, name: str) -> Any:
        """``self.log`` / ``self.log_dict`` inside a hook: those of the running Trainer's module (same
        options; logged under the hook's name), as Lightning, which sets them on each callback. Found
        here, on the instance, not as methods of the class: Lightning's ``Callback`` has no such
        members, and code that lists its hooks from the class (a LambdaCallback of every member)
        must not find them."""
        if name in ("log", "log_dict"):
            from ..trainer.logs.connector import running_module

            def call(*args: Any, **kwargs: Any) -> None:  # resolved when called (a clear error outside a hook)
                getattr(running_module(f"{type(self).__name__}.{name}"), name)(*args, **kwargs)

            return call
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def stage_hooks(cls: type) -> type:
    """Give ``cls`` the test and predict hooks: the validation hooks' no-ops (same signatures) under
    their own names, each overridable alone."""
    for when in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end"):
        for stage in ("test", "predict"):
            setattr(cls, f"on_{stage}_{when}", getattr(cls, f"on_validation_{when}"))
    return cls


stage_hooks(Callback)


class Logger:
    """Lightning's ``Logger`` interface, for loggers of one's own. The Trainer calls
    ``log_metrics`` (then ``save``) on global rank 0 only, so a logger written for Lightning
    (its methods under ``@rank_zero_only``) behaves the same; ``finalize(status)`` at the end of
    fit. ``experiment`` (the backend's object) is the concrete logger's, and ``rank_zero_experiment``
    gives other ranks a do-nothing stand-in, as Lightning's."""

    @property
    def name(self) -> str | None:
        return None

    @property
    def version(self) -> int | str | None:
        return None

    @property
    def root_dir(self) -> str | None:
        return None

    @property
    def log_dir(self) -> str | None:
        return None

    @property
    def save_dir(self) -> str | None:
        return None

    @property
    def group_separator(self) -> str:
        return "/"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None: ...
    def log_graph(self, model: Any, input_array: Any = None) -> None: ...
    def save(self) -> None: ...

    def finalize(self, status: str = "success") -> None:
        """The run ended (``status``: "success" or "failed"): write what is buffered."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None: ...


class _DummyExperiment:
    """Every attribute a no-op callable (and indexable), for ranks other than 0."""

    def nop(self, *args: Any, **kwargs: Any) -> None: ...

    def __getattr__(self, _: str) -> Any:
        return self.nop

    def __getitem__(self, idx: int) -> "_DummyExperiment":
        return self

    def __setitem__(self, *args: Any) -> None: ...


class DummyLogger(Logger):
    """Lightning's ``DummyLogger``: logs nothing; its ``experiment`` swallows every call; name and
    version are empty strings (the Trainer's only logger under ``fast_dev_run``, as Lightning's)."""

    @property
    def experiment(self) -> _DummyExperiment:
        return _DummyExperiment()

    name = property(lambda self: "")
    version = property(lambda self: "")

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        """Takes any arguments and does nothing, as Lightning's."""

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        """Takes any arguments and does nothing, as Lightning's."""

    def __getitem__(self, idx: int) -> "DummyLogger":
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _DummyExperiment().nop


def rank_zero_experiment(fn: Any) -> Any:
    """Decorate a logger's ``experiment`` property body: the real object on global rank 0, a
    do-nothing stand-in elsewhere (Lightning's ``rank_zero_experiment``)."""
    import functools

    from ..trainer.utilities import global_rank

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        return fn(self) if global_rank() == 0 else _DummyExperiment()

    return experiment


class VersionedLogger(Logger):
    """A logger writing under Lightning's ``<save_dir>/<name>/version_<n>`` (``version_dir``): the
    version is fixed the first time the directory is asked for."""

    def __init__(self, save_dir: str, name: str, version: "int | str | None") -> None:
        self._save_dir, self._name, self._version = save_dir, name, version

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> "int | str":
        """Fixed the first time it is asked for (None: the next free number under ``root_dir``)."""
        if self._version is None:
            _, self._version = version_dir(self.save_dir, self.name, None)
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self.save_dir, self.name)

    @property
    def log_dir(self) -> str:
        """``root_dir/version_<n>`` (a string version as it is), from the ``name`` and ``version``
        properties, so a subclass overriding them moves the directory, as Lightning's."""
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")


def version_dir(save_dir: str, name: str, version: "int | str | None") -> tuple[str, "int | str"]:
    """Lightning's layout ``<save_dir>/<name>/version_<n>``: ``version=None`` takes the next free
    number; a string is used as the directory name. Returns the directory and the version chosen,
    which the logger keeps so that its directory does not move once files are written."""
    root = os.path.join(save_dir, name)
    if version is None:
        existing = [d for d in os.listdir(root) if d.startswith("version_")] if os.path.isdir(root) else []
        nums = [int(d.split("_")[1]) for d in existing if d.split("_")[1].isdigit()]
        version = max(nums, default=-1) + 1
    return os.path.join(root, version if isinstance(version, str) else f"version_{version}"), version
