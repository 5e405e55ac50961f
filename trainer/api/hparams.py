"""Hyperparameters, as Lightning's ``save_hyperparameters`` / ``self.hparams``.

``save_hyperparameters()`` collects the arguments the module's ``__init__`` (and those of the
TrainModule / DataModule subclasses above it) was called with, as Lightning does, into
``self.hparams`` (an :class:`AttributeDict`, mutable) and a frozen copy ``self.hparams_initial``.

The Trainer then

* logs ``hparams_initial`` once per stage to every logger's ``log_hyperparams`` on global rank 0
  (:func:`log_hyperparams`, after ``on_fit_start`` as Lightning; the datamodule's are merged in);
* stores ``hparams`` in every checkpoint's metadata (:func:`checkpoint_entries`), which
  ``TrainModule.load_from_checkpoint`` uses to rebuild the module. That metadata is read with
  ``torch.load(weights_only=True)`` (a checkpoint never runs code), so only plain values can be
  stored: numbers, strings, None, lists / tuples / dicts of them, tensors, dtypes. A value that
  would not load back that way (an ``nn.Module``, a dataclass, a class) is left out of the
  checkpoint with one warning naming the hyperparameter; pass it to ``load_from_checkpoint`` as
  an override instead.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import json
import logging
import types
import warnings
from argparse import Namespace
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Sequence

import torch
from torch import nn

log = logging.getLogger("zerotrain")

#: the metadata keys (Lightning's checkpoint keys, under the same names)
HPARAMS_KEY = "hyper_parameters"
HPARAMS_NAME_KEY = "hparams_name"
DATAMODULE_HPARAMS_KEY = "datamodule_hyper_parameters"
HPARAMS_TYPE_KEY = "hparams_type"
#: the datamodule's hyperparameters, their argument name and their container's type
DATAMODULE_KEYS = (DATAMODULE_HPARAMS_KEY, "datamodule_hparams_name", "datamodule_hparams_type")

_PRIMITIVES = (bool, int, float, str)

#: the hyperparameters a builder gave for the module being constructed (``zerotrain.cli``):
#: ``save_hyperparameters`` stores them instead of reading the ``__init__`` frame
_GIVEN: ContextVar = ContextVar("zerotrain_given_hparams", default=None)
#: the key naming the function that rebuilds the module from them (``load_from_checkpoint``)
INSTANTIATOR_KEY = "_instantiator"
#: and the subclass it built (subclass mode), stored beside the arguments
CLASS_PATH_KEY = "_class_path"


@contextmanager
def given_hyperparameters(hparams: dict[str, Any], instantiator: str) -> Iterator[None]:
    """Within: ``save_hyperparameters`` saves ``hparams`` plus ``_instantiator: instantiator``
    (the import path of the function ``load_from_checkpoint`` rebuilds the module with)."""
    token = _GIVEN.set({**hparams, INSTANTIATOR_KEY: instantiator})
    try:
        yield
    finally:
        _GIVEN.reset(token)


class AttributeDict(dict):
    """A dict whose keys are also attributes (``hparams.lr``), as Lightning's."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as exc:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from exc

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        del self[key]

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(k)) for k in self) + 3
        return "\n".join(f"{_quoted(k):{width}} {self[k]}" for k in sorted(self.keys()))


def _quoted(key: Any) -> str:
    return '"' + str(key) + '":'


class HyperparametersMixin:
    """``save_hyperparameters``, ``hparams`` and ``hparams_initial`` for TrainModule and
    DataModule. No ``__init__``: the attributes appear on first use, so ``nn.Module``'s
    constructor order is untouched."""

    #: log the hyperparameters to the loggers (``save_hyperparameters(logger=...)``)
    _log_hyperparams = False

    def save_hyperparameters(self, *args: Any, ignore: "Sequence[str] | str | None" = None,
                             frame: types.FrameType | None = None, logger: bool = True) -> None:
        """Save the ``__init__`` arguments as ``self.hparams``: all of them (``*args`` empty),
        the names given as strings, or the one dict / Namespace given; ``ignore``: names left
        out; ``frame``: the ``__init__`` frame to read (default: the caller's); ``logger``:
        whether the Trainer logs them."""
        self._log_hyperparams = logger
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return  # an empty container: nothing to save, as Lightning
        given = _GIVEN.get()
        if frame is None and given is None:
            frame = inspect.currentframe().f_back
        if given is None and not isinstance(frame, types.FrameType):
            raise AttributeError("save_hyperparameters: no frame to read the __init__ arguments from")
        ignored = _ignored(ignore)
        if given is not None:  # built by the CLI: its parsed values, as given
            collected = dict(given)
        elif dataclasses.is_dataclass(self):  # as Lightning: a dataclass module's init fields (from __post_init__)
            collected = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        else:
            collected = _collect_init_args(frame, (HyperparametersMixin,))
        init_args = {k: v for k, v in collected.items() if k not in ignored}
        strings = [a for a in args if isinstance(a, str)]
        objects = [a for a in args if not isinstance(a, str)]
        if not args:
            hp, self._hparams_name = init_args, ("kwargs" if init_args else None)
        elif len(objects) == 1:
            hp = objects[0]
            self._hparams_name = next((k for k, v in init_args.items() if v is hp or _equal(v, hp)), None)
        else:
            hp, self._hparams_name = {name: init_args[name] for name in strings}, "kwargs"
        self._set_hparams(hp)
        for name in ignored:
            self.hparams.pop(name, None)
        for name, value in self.hparams.items():
            if isinstance(value, nn.Module):  # Lightning's warning
                warnings.warn(f"Attribute {name!r} is an instance of `nn.Module` and is already saved during "
                              f"checkpointing. It is recommended to ignore them using "
                              f"`self.save_hyperparameters(ignore=[{name!r}])`.", UserWarning, stacklevel=2)
        self._hparams_initial = copy.deepcopy(self._hparams)

    def _set_hparams(self, hp: Any) -> None:
        if isinstance(hp, Namespace):
            hp = vars(hp)
        if isinstance(hp, _PRIMITIVES):
            raise ValueError(f"Primitives {_PRIMITIVES} are not allowed. save_hyperparameters({hp!r}): valid: "
                             "argument names, or one dict / Namespace")
        if not isinstance(hp, MutableMapping):
            raise ValueError(f"save_hyperparameters: unsupported config type {type(hp).__name__}; valid: "
                             "argument names, or one dict / Namespace")
        if isinstance(hp, dict) and not isinstance(hp, AttributeDict):
            hp = AttributeDict(hp)
        if isinstance(self.hparams, dict) and isinstance(hp, dict):
            self.hparams.update(hp)
        else:
            self._hparams = hp

    @property
    def hparams(self) -> "AttributeDict | MutableMapping":
        """The saved hyperparameters; mutable (``hparams_initial`` keeps the originals)."""
        if "_hparams" not in self.__dict__:
            self._hparams = AttributeDict()
        return self.__dict__["_hparams"]

    @property
    def hparams_initial(self) -> AttributeDict:
        """A copy of the hyperparameters as ``save_hyperparameters`` saved them."""
        initial = self.__dict__.get("_hparams_initial")
        return copy.deepcopy(initial) if initial is not None else AttributeDict()


def _ignored(ignore: "Sequence[str] | str | None") -> set[str]:
    if ignore is None:
        return set()
    if isinstance(ignore, str):
        return {ignore}
    return {name for name in ignore if isinstance(name, str)}


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - tensors and other values without a plain truth value
        return False


def _init_args_of(frame: types.FrameType) -> tuple[Any, dict[str, Any]]:
    """The object an ``__init__`` frame constructs and the arguments of its signature (``**kwargs``
    spread out, ``self`` / ``*args`` / ``**kwargs`` themselves left out), or (None, {})."""
    local_vars = frame.f_locals
    if "__class__" not in local_vars or frame.f_code.co_name != "__init__":
        return None, {}
    params = list(inspect.signature(local_vars["__class__"].__init__).parameters.values())
    self_name = params[0].name
    var_names = {p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    args = {p.name: local_vars[p.name] for p in params if p.name in local_vars}
    for p in params:
        if p.kind == p.VAR_KEYWORD:
            args.update(args.get(p.name, {}))
    drop = {self_name, "__class__", "frame", "frame_args"} | var_names
    return local_vars.get(self_name), {k: v for k, v in args.items() if k not in drop}


def _collect_init_args(frame: types.FrameType, classes: tuple[type, ...]) -> dict[str, Any]:
    """Walk out from ``frame`` through the chain of ``__init__`` frames constructing one object
    of ``classes`` (a subclass's ``__init__`` calls its parent's): the outermost (most derived)
    class's arguments win, as Lightning's ``collect_init_args``."""
    levels: list[dict[str, Any]] = []
    inside = False
    while isinstance(frame, types.FrameType) and isinstance(frame.f_back, types.FrameType):
        obj, args = _init_args_of(frame)
        if "__class__" in frame.f_locals and frame.f_code.co_name == "__init__" and isinstance(obj, classes):
            levels.append(args)
            inside = True
        elif inside:
            break
        frame = frame.f_back
    out: dict[str, Any] = {}
    for args in levels:
        out.update(args)
    return out


# ---------------------------------------------------------------------------- checkpoints

def plain(value: Any) -> Any:
    """``value`` with AttributeDicts, Namespaces and OmegaConf containers as plain dicts and lists
    (what a weights-only load rebuilds; interpolations resolved), containers walked."""
    if isinstance(value, Namespace):
        value = vars(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(plain(v) for v in value)
    return value


def loads_safely(value: Any) -> bool:
    """Does ``value`` come back from ``torch.save`` + ``torch.load(weights_only=True)``? Its
    objects (tensors aside, which always do) pickled as ``torch.save`` pickles them, read back by
    torch's weights-only unpickler: no file, and no ``torch.save`` call (Lightning's tests count
    those to count checkpoints)."""
    import pickle

    from torch._weights_only_unpickler import Unpickler

    try:
        Unpickler(io.BytesIO(pickle.dumps(_without_tensors(value), protocol=2)), encoding="utf-8").load()
    except Exception:  # noqa: BLE001 - any failure means: not storable in the metadata
        return False
    return True


def _without_tensors(obj: Any) -> Any:
    """``obj`` with every tensor inside plain dicts, lists and tuples replaced by None."""
    if isinstance(obj, torch.Tensor):
        return None
    if type(obj) in (dict, list, tuple):
        if type(obj) is dict:
            return {k: _without_tensors(v) for k, v in obj.items()}
        return type(obj)(_without_tensors(v) for v in obj)
    return obj


def clean_namespace(hparams: MutableMapping) -> None:
    """Lightning's ``clean_namespace``, run as each stage starts: every hyperparameter that cannot
    be pickled (``is_picklable``) is removed, with Lightning's warning naming it."""
    for name in [k for k, v in hparams.items() if not is_picklable(v)]:
        warnings.warn(f"Attribute '{name}' removed from hparams because it cannot be pickled. You can suppress "
                      f"this warning by setting `self.save_hyperparameters(ignore=['{name}'])`.", UserWarning,
                      stacklevel=3)
        del hparams[name]


def is_picklable(obj: object) -> bool:
    """Lightning's ``is_picklable``: ``pickle.dumps(obj)`` succeeds (False where pickling raises a
    pickling, attribute, runtime or type error; other errors propagate)."""
    import pickle

    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True


_warned: set[tuple[str, str]] = set()


def storable(hparams: MutableMapping, owner: str) -> dict[str, Any]:
    """The hyperparameters a checkpoint's metadata can hold: each one that loads back with
    ``weights_only=True``; the others are left out with one warning each, naming them."""
    out = {}
    for name, value in hparams.items():
        value = plain(value)
        if loads_safely({name: value}):
            out[name] = value
        elif (owner, str(name)) not in _warned:
            _warned.add((owner, str(name)))
            log.warning("%s hparam %r (%s) is not stored in the checkpoint: its metadata is loaded with "
                        "weights_only=True and holds plain values only (numbers, strings, None, lists/tuples/"
                        "dicts of them, tensors); pass it to load_from_checkpoint(..., %s=...) instead, or "
                        "save_hyperparameters(ignore=[%r])", owner, name, type(value).__name__, name, name)
    return out


def checkpoint_entries(module: Any, datamodule: Any) -> dict[str, Any]:
    """What a save adds to the metadata: the module's hyperparameters and how they were given
    (``hparams_name``: ``"kwargs"``, or the ``__init__`` argument that was the config object;
    ``hparams_type``: the container's class name, so a DictConfig comes back as one), and the
    datamodule's, under Lightning's checkpoint keys (TrainModule's and DataModule's ``CHECKPOINT_HYPER_PARAMS_*``)."""
    out: dict[str, Any] = {}
    for owner, keys in ((module, (HPARAMS_KEY, HPARAMS_NAME_KEY, HPARAMS_TYPE_KEY)),
                        (datamodule, DATAMODULE_KEYS)):
        if owner is not None and isinstance(owner, HyperparametersMixin) and owner.hparams:
            out[keys[0]] = storable(owner.hparams, type(owner).__name__)
            out[keys[1]] = getattr(owner, "_hparams_name", None)
            out[keys[2]] = type(owner.hparams).__name__
    return out


#: the safetensors metadata key a consolidated file keeps the hyperparameters under (JSON)
SAFETENSORS_HPARAMS = "zerotrain.hyper_parameters"


def hparams_metadata(meta: dict[str, Any]) -> dict[str, str]:
    """For a consolidated safetensors file: the checkpoint's hyperparameters as one JSON string
    (and how they were given), or nothing when they are not all JSON values."""
    hparams = meta.get(HPARAMS_KEY)
    if not hparams:
        return {}
    try:
        return {SAFETENSORS_HPARAMS: json.dumps({"hparams": hparams, "name": meta.get(HPARAMS_NAME_KEY)})}
    except (TypeError, ValueError):
        return {}


# ---------------------------------------------------------------------------- loggers

def merged_for_logging(module: Any, datamodule: Any) -> dict[str, Any] | None:
    """Lightning's rule: the module's initial hparams and the datamodule's, each only if it asked
    to be logged; a key in both with different values is an error. The class a LightningCLI
    built in subclass mode (``_class_path``) is not logged, as Lightning."""
    from_module = module is not None and module._log_hyperparams
    from_dm = isinstance(datamodule, HyperparametersMixin) and datamodule._log_hyperparams
    if from_module and from_dm:
        ours, theirs = module.hparams_initial, datamodule.hparams_initial
        clash = sorted(str(k) for k in ours.keys() & theirs.keys() - {CLASS_PATH_KEY} if not _same(ours[k], theirs[k]))
        if clash:
            raise RuntimeError(f"Error while merging hparams: the keys {clash} are present in both the "
                               "TrainModule's and DataModule's hparams but have different values.")
        merged = {**ours, **theirs}
    elif from_module or from_dm:
        merged = dict((module if from_module else datamodule).hparams_initial)
    else:
        return None
    merged.pop(CLASS_PATH_KEY, None)
    return merged


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        return a is b
    return _equal(a, b)


def log_hyperparams(trainer: Any) -> None:
    """Global rank 0: hand the hyperparameters to every logger (``log_hyperparams``), then let
    each write them out (``save``), once per stage as Lightning does."""
    if not trainer.loggers:
        return
    hparams = merged_for_logging(trainer.module, trainer.datamodule)  # a clash raises on every rank
    if not trainer.is_global_zero:
        return
    for lg in trainer.loggers:
        if hparams is not None:
            lg.log_hyperparams(hparams)
        if callable(getattr(lg, "log_graph", None)):
            lg.log_graph(trainer.module)
        save = getattr(lg, "save", None)
        if callable(save):
            save()
