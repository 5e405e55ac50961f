"""The Trainer's settings, declared once: :class:`TrainerSettings` lists every ``Trainer.__init__``
argument with its type, default, one line of documentation and its check. From it are built:

* ``Trainer.__init__``'s signature and the checks of its arguments (:func:`declared`): the
  constructor's parameter list names the settings (and nothing else), the declaration gives their
  types and defaults (``inspect.signature(Trainer)``, read by LightningCLI/jsonargparse and by
  ``PL_TRAINER_*`` defaults) and refuses a bad value when the Trainer is built, in one line
  (``Trainer: field=value; valid: ...``), before anything starts;
* the Engine's shared settings (``ENGINE``: accelerator, devices, num_nodes, strategy, precision,
  seed), the same types, defaults and checks (its messages read ``Engine: ...``);
* the ``trainer`` schema of ``zerotrain-train`` (``trainer/command/config.py``): the settings marked
  ``cli``, with the CLI's own defaults and, where the command line is narrower, its type.

Checks take the value and the whole settings (for the few that depend on another one: ``devices``
on ``accelerator``); normalising a value (``"gpu"`` -> ``"cuda"``, ``devices="auto"`` -> a count)
stays with the constructor that keeps it.
"""
import dataclasses
import functools
import inspect
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

from ...callbacks.base import Callback, Logger
from ...strategies import Strategy
from ...strategies.paths import directory_problem
from ..compat.lightning.profilers import Profiler
from ..errors import ConfigError
from . import plugin_checks, run_options
from .arguments import (check_clip_val, check_limit, check_lightning_args, check_max_limits, check_val_schedule,
                        positive_int, positive_number)

#: seconds a rank may make no progress while another waits for it (trainer/launch/watchdog.py)
DEFAULT_STALL_TIMEOUT_S = 20.0
#: what a non-finite training loss does under fp32/bf16 (16-mixed: the loss scaler skips the step)
NONFINITE_POLICIES = ("raise", "skip", "warn")
#: the accelerators the Trainer and the Engine run on ("gpu": Lightning's name for cuda)
ACCELERATORS = ("cpu", "cuda", "gpu", "auto")


def canonical_accelerator(accelerator: str) -> str:
    return "cuda" if accelerator == "gpu" else accelerator


def _accelerator(value: Any, s: Any) -> None:
    if not isinstance(value, str) or value not in ACCELERATORS:
        raise ConfigError(f"Trainer: accelerator={value!r}; valid choices: cpu, cuda (or gpu), auto")


def _devices(value: Any, s: Any) -> None:
    positive_int("devices", run_options.device_count(value, canonical_accelerator(s.accelerator)))


def _seed(value: Any, s: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"Trainer: seed={value!r}; valid: None (do not seed) or an int")


def _on_nonfinite(value: Any, s: Any) -> None:
    if value not in NONFINITE_POLICIES:
        raise ConfigError(f"Trainer: on_nonfinite={value!r}; valid choices: {', '.join(NONFINITE_POLICIES)}")


def _bool(name: str, none: bool = False, also: tuple = ()) -> Callable[[Any, Any], None]:
    """A flag: True or False (1 and 0 too, as Python reads them), None where it means the default;
    a string such as ``"no"`` (``PL_TRAINER_ENABLE_CHECKPOINTING=no``) is refused, not read as True."""
    def check(value: Any, s: Any) -> None:
        if not ((isinstance(value, int) and value in (0, 1)) or (none and value is None) or value in also):
            valid = ", ".join(["True", "False", *map(repr, also)] + (["None (the default)"] if none else []))
            raise ConfigError(f"Trainer: {name}={value!r}; valid: {valid}")
    return check


def _count(name: str, minimum: int, none: bool = False) -> Callable[[Any, Any], None]:
    return lambda value, s: positive_int(name, value, allow_none=none, minimum=minimum)


def _seconds(name: str, what: str) -> Callable[[Any, Any], None]:
    return lambda value, s: positive_number(name, value, what)


def _limit(name: str) -> Callable[[Any, Any], None]:
    return lambda value, s: check_limit(name, value, allow_zero=True)


def _max_limits(value: Any, s: Any) -> None:
    check_max_limits(s.max_epochs, s.max_steps)


def _val_check_interval(value: Any, s: Any) -> None:
    check_val_schedule(value, s.check_val_every_n_epoch)
    run_options.val_check_seconds(value)


def _root_dir(value: Any, s: Any) -> None:
    """None or "" (the working directory), or a directory that is or can be made writable."""
    if value is None or value == "":
        return
    problem = directory_problem(os.path.expanduser(value) if isinstance(value, (str, os.PathLike)) else value)
    if problem:
        raise ConfigError(f"Trainer: default_root_dir={value!r} {problem}; valid: a writable directory on a real "
                          "file system (created if missing)")


def _lightning_args(value: Any, s: Any) -> None:
    """Lightning's debugging and stopping arguments, checked together as Lightning does."""
    check_lightning_args(value, s.num_sanity_val_steps, s.check_val_every_n_epoch, s.min_epochs,
                         s.min_steps, s.overfit_batches, s.gradient_clip_algorithm)


def _callbacks(value: Any, s: Any) -> None:
    plugin_checks.check_callbacks(value)


def _logger(value: Any, s: Any) -> None:
    plugin_checks.check_logger(value)


def _plugins(value: Any, s: Any) -> None:
    plugin_checks.check_plugins(value)


def _run_options(value: Any, s: Any) -> None:
    run_options.check_run_options(s.inference_mode, s.reload_dataloaders_every_n_epochs, s.profiler)


def _benchmark(value: Any, s: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"Trainer: benchmark={value!r}; valid: True, False or None (keep the session's)")


def setting(default: Any, doc: str, check: Callable[[Any, Any], None] | None = None, cli: Any = False,
            engine: bool = False) -> Any:
    """One setting: its default, one line of documentation, its check ``check(value, settings)``
    (raises ConfigError naming the field, the value and what is valid); ``cli``: the ``trainer``
    section of ``zerotrain-train`` has it (True, or the narrower type the command line takes);
    ``engine``: the Engine takes it too."""
    return field(default=default, metadata={"doc": doc, "check": check, "cli": cli, "engine": engine})


@dataclass(frozen=True)
class TrainerSettings:
    """Every argument of ``Trainer.__init__``, in its order. Building one checks every value."""
    accelerator: str = setting("auto", "cpu, cuda (or gpu) or auto", _accelerator, cli=True, engine=True)
    devices: int | str = setting("auto", "processes per node: an int, 'auto', -1 (all), or a list of indices",
                                 _devices, cli=int, engine=True)
    num_nodes: int = setting(1, "nodes of the job", _count("num_nodes", 1), cli=True, engine=True)
    strategy: str | Strategy = setting("auto", "a registered strategy's name or a Strategy", engine=True)
    precision: str | int = setting("32", "Lightning's precision names ('32', 'bf16-mixed', '16-mixed', ...)",
                                   engine=True)
    max_steps: int = setting(-1, "optimizer steps to train for; -1: no limit", _max_limits, cli=True)
    max_epochs: int | None = setting(None, "epochs to train for; None: Lightning's rule, -1: no limit",
                                     cli=True)
    accumulate_grad_batches: int = setting(1, "micro-batches per optimizer step", _count("accumulate_grad_batches", 1),
                                           cli=True)
    gradient_clip_val: float | None = setting(None, "clip gradients at this bound; None or 0: off",
                                              lambda v, s: check_clip_val(v), cli=True)
    val_check_interval: int | float | str | timedelta | dict[str, int] | None = setting(
        None, "validate every n steps (int), fraction of an epoch (float) or duration",
        _val_check_interval, cli=Any)
    limit_train_batches: int | float | None = setting(None, "training batches per epoch (int) or fraction (float)",
                                                      _limit("limit_train_batches"), cli=Any)
    limit_val_batches: int | float | None = setting(None, "validation batches (int) or fraction (float)",
                                                    _limit("limit_val_batches"), cli=Any)
    limit_test_batches: int | float | None = setting(None, "test batches (int) or fraction (float)",
                                                     _limit("limit_test_batches"))
    limit_predict_batches: int | float | None = setting(None, "predict batches (int) or fraction (float)",
                                                        _limit("limit_predict_batches"))
    log_every_n_steps: int | None = setting(None, "logger rows every n steps; None: 50, 0: never",
                                            _count("log_every_n_steps", 0, none=True), cli=int)
    callbacks: list[Callback] | Callback | None = setting(None, "callbacks besides the default ones", _callbacks)
    logger: bool | Logger | Sequence[Logger] | None = setting(None, "True: TensorBoard, False: none, or loggers",
                                                              _logger)
    enable_checkpointing: bool | None = setting(None, "a default ModelCheckpoint; None: on unless barebones",
                                                _bool("enable_checkpointing", none=True), cli=bool)
    enable_progress_bar: bool | None = setting(None, "a progress bar; None: on unless barebones",
                                               _bool("enable_progress_bar", none=True), cli=bool)
    default_root_dir: str | None = setting(None, "where logs and checkpoints go; None: the working directory",
                                           _root_dir, cli=True)
    seed: int | None = setting(None, "seed every rank's global RNGs at set-up; None: leave them as seeded",
                               _seed, cli=True, engine=True)
    deterministic: bool = setting(False, "torch.use_deterministic_algorithms(True)",
                                  _bool("deterministic", also=("warn",)), cli=True)
    max_restarts: int = setting(0, "restart the workers after a failure, resuming from 'latest'",
                                _count("max_restarts", 0), cli=True)
    collective_timeout_s: float | None = setting(None, "process-group timeout after the first step",
                                                 _seconds("collective_timeout_s", "seconds"), cli=True)
    on_nonfinite: str = setting("raise", "a nan/inf training loss under fp32/bf16: raise, skip or warn",
                                _on_nonfinite, cli=True)
    stall_timeout_s: float | None = setting(DEFAULT_STALL_TIMEOUT_S, "a rank without progress ends the job; None: off",
                                            _seconds("stall_timeout_s", "seconds; None disables the progress "
                                                     "watchdog"), cli=True)
    use_distributed_sampler: bool = setting(True, "wrap loaders in a DistributedSampler", _bool(
        "use_distributed_sampler"))
    fast_dev_run: bool | int = setting(False, "run n batches of each loop (True: 1) as a smoke test", _lightning_args)
    num_sanity_val_steps: int | None = setting(None, "validation batches before training; None: 2, -1: all")
    check_val_every_n_epoch: int | None = setting(1, "validate every n epochs; None: by val_check_interval only")
    min_epochs: int | None = setting(None, "train at least this many epochs")
    min_steps: int | None = setting(None, "train at least this many steps")
    max_time: str | timedelta | dict[str, int] | None = setting(None, "stop after this duration ('DD:HH:MM:SS')")
    overfit_batches: int | float = setting(0.0, "train and validate on this many training batches")
    gradient_clip_algorithm: str | None = setting(None, "norm or value; None: norm")
    enable_model_summary: bool | None = setting(None, "a ModelSummary; None: on unless barebones",
                                                _bool("enable_model_summary", none=True))
    detect_anomaly: bool = setting(False, "torch.autograd's anomaly detection", _bool("detect_anomaly"))
    inference_mode: bool = setting(True, "evaluate under torch.inference_mode (else no_grad)", _run_options)
    reload_dataloaders_every_n_epochs: int = setting(0, "rebuild the loaders every n epochs; 0: never")
    benchmark: bool | None = setting(None, "cudnn.benchmark; None: the session's", _benchmark)
    profiler: Profiler | str | None = setting(None, "None, 'simple' or a Profiler")
    barebones: bool = setting(False, "switch off everything that costs speed", _bool("barebones"))
    plugins: Any = setting(None, "Lightning's; None or [] only", _plugins)
    compile: Any = setting(None, "torch.compile per block: True, or {backend, mode, regional}", cli=Any)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = f.metadata["check"]
            if check is not None:
                check(getattr(self, f.name), self)


#: the settings the Engine shares with the Trainer
ENGINE = tuple(f.name for f in dataclasses.fields(TrainerSettings) if f.metadata["engine"])
#: the settings the ``trainer`` section of ``zerotrain-train`` has
CLI = tuple(f.name for f in dataclasses.fields(TrainerSettings) if f.metadata["cli"])
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainerSettings)}


def defaults(names: Sequence[str] | None = None) -> dict[str, Any]:
    """The declared defaults of ``names`` (all settings by default)."""
    return {n: _DEFAULTS[n] for n in (names or _DEFAULTS)}


def check(values: dict[str, Any], owner: str = "Trainer") -> None:
    """Run the declared checks of ``values`` (the others at their defaults). Raises ConfigError
    (a TypeError for Lightning's ``gradient_clip_val`` and the plugin checks), worded for ``owner``."""
    try:
        TrainerSettings(**values)
    except (ConfigError, TypeError) as exc:
        if owner == "Trainer" or not str(exc).startswith("Trainer: "):
            raise
        raise type(exc)(f"{owner}: {str(exc)[len('Trainer: '):]}") from None


def signature(names: Sequence[str]) -> inspect.Signature:
    """``self`` and the keyword-only parameters ``names``, typed and defaulted as declared."""
    hints = {f.name: f.type for f in dataclasses.fields(TrainerSettings)}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=_DEFAULTS[n], annotation=hints[n])
               for n in names]
    return inspect.Signature(params, return_annotation=None)


def declared(owner: str = "Trainer", names: Sequence[str] | None = None) -> Callable[[Callable], Callable]:
    """Decorates a constructor whose keyword-only parameters (no defaults, no annotations) are
    ``names`` (every setting by default): its signature becomes the declared one, arguments not
    given take their declared defaults, and every value is checked before the body runs. An
    unknown keyword is Python's TypeError, as for any signature."""
    names = tuple(names or _DEFAULTS)

    def decorate(init: Callable) -> Callable:
        params = [p.name for p in inspect.signature(init).parameters.values() if p.kind == p.KEYWORD_ONLY]
        if tuple(params) != names:
            raise TypeError(f"{init.__qualname__} takes {params}; the declaration (trainer/settings/declaration.py) "
                            f"has {list(names)}")
        sig = signature(names)

        @functools.wraps(init)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                bound = sig.bind(self, *args, **kwargs)
            except TypeError as exc:  # in Python's words for a call: "Trainer.__init__() got an unexpected ..."
                raise TypeError(f"{init.__qualname__}() {exc}") from None
            bound.apply_defaults()
            values = {k: v for k, v in bound.arguments.items() if k != "self"}
            check(values, owner)
            return init(self, **values)

        wrapped.__signature__ = sig
        wrapped.__annotations__ = {n: p.annotation for n, p in sig.parameters.items() if n != "self"}
        wrapped.__annotations__["return"] = None
        return wrapped

    return decorate
