"""``TrainModule.load_from_checkpoint``: a trained module back in one process, for inference.

Accepted, whatever strategy and world size wrote them:

* a sharded checkpoint directory (or a ModelCheckpoint directory: its ``latest``): the shard
  files are verified, then every key of the module's state dict is assembled from the ranges the
  files hold (``consolidate.plan`` over a ``CheckpointReader``), in this process, without a
  process group;
* a consolidated file (``zerotrain-consolidate``, a ModelCheckpoint ``save_weights_only`` file):
  ``.safetensors`` (its header carries the hyperparameters when they are JSON values), or a
  ``torch.save`` state dict (``.pt``/``.pth``/``.bin``, read with ``weights_only=True``; a
  Lightning ``.ckpt``-style dict with ``state_dict`` and ``hyper_parameters`` too).

Lightning's order: the class is built from the saved hyperparameters updated with the
overrides, ``configure_model`` runs if the class overrides it, ``on_load_checkpoint(checkpoint)``
gets the metadata with the full ``state_dict`` in it (the hook may edit it), and that state dict
is loaded with ``strict``. A pipeline checkpoint holds every stage's layers under their original
names; a pipeline module holds only its own stage's, so such a checkpoint loads into a plain
class of the same layers (its ``on_load_checkpoint`` may rename the keys).
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import directory as checkpoint_io, url as url_checkpoint
from ..checkpoint.consolidate import plan
from ..errors import CheckpointError, ConfigError
from .hparams import (CLASS_PATH_KEY, HPARAMS_KEY, HPARAMS_NAME_KEY, INSTANTIATOR_KEY, SAFETENSORS_HPARAMS,
                      AttributeDict)
from ..checkpoint.reshard import CheckpointReader
from ..checkpoint.tensor_files import SafetensorsFile

log = logging.getLogger("zerotrain")

#: where checkpoints of Lightning before 1.0 kept a module's hyperparameters (the older first)
PAST_HPARAMS_KEYS = ("hparams", "module_arguments")

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at ``path`` as Lightning's dict: its metadata (``hyper_parameters``,
    ``hparams_name``, the loop...) with the full model state under ``state_dict`` (fp32, CPU).
    A URL is downloaded and read as a local file (``trainer/checkpoint/url.py``)."""
    if url_checkpoint.is_url(path):
        with url_checkpoint.local_copy(str(path)) as local:
            return read_checkpoint(local)
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return _read_safetensors(p)
    if p.is_file() and p.suffix in _TORCH_SUFFIXES:
        return _read_torch_file(p)
    if p.is_file() and p.name != checkpoint_io.LATEST:
        raise ConfigError(f"load_from_checkpoint: checkpoint_path={str(p)!r}; valid: a checkpoint directory, a "
                          f"ModelCheckpoint directory, or a .safetensors / {' / '.join(_TORCH_SUFFIXES)} file")
    root, meta = checkpoint_io.load_meta(p)
    checkpoint_io.verify(root, meta)
    with CheckpointReader(root, meta) as reader:
        state = {e.key: e.produce().reshape(e.shape) for e in plan(meta, reader)}
    return {**meta, "state_dict": state}


def load_checkpoint(path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's ``lightning.fabric.utilities.cloud_io._load`` for the checkpoints zerotrain reads:
    ``read_checkpoint(path)`` (a checkpoint directory or a consolidated file, as Lightning's dict),
    its tensors on ``map_location`` (None: the CPU; else as ``torch.load``'s: :func:`map_tensors`). Always read
    weights-only (a checkpoint never runs code here), whatever ``weights_only`` says: a file that
    needs pickled code is a CheckpointError. A URL is downloaded first, as Lightning's; file
    objects are not read (a ConfigError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load_checkpoint: path={path!r}; valid: a checkpoint directory or file path, or a URL")
    return map_tensors(read_checkpoint(path), map_location)


def _read_safetensors(path: Path) -> dict[str, Any]:
    with SafetensorsFile(path) as f:
        state = {k: f.read(k) for k in f.keys()}
        raw = f.metadata.get(SAFETENSORS_HPARAMS)
    out: dict[str, Any] = {"state_dict": state}
    if raw:
        try:
            saved = json.loads(raw)
            out.update({HPARAMS_KEY: dict(saved["hparams"]), HPARAMS_NAME_KEY: saved.get("name")})
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint file {str(path)!r}: its {SAFETENSORS_HPARAMS} metadata is not "
                                  f"what zerotrain writes: {exc}") from None
    return out


def _read_torch_file(path: Path) -> dict[str, Any]:
    checkpoint_io.check_archive(path, max_bytes=None, crc=False)  # weights may be large: no size cap, one read
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickled code, truncation, another format
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r} with weights_only=True (a checkpoint "
                              f"never runs code here): {exc}") from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        return dict(obj)  # Lightning's layout: state_dict, hyper_parameters, ...
    if isinstance(obj, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        return {"state_dict": obj}
    raise CheckpointError(f"checkpoint file {str(path)!r} holds a {type(obj).__name__}; valid: a state dict "
                          "(name -> tensor), or a dict with a 'state_dict'")


def init_kwargs(cls: type, hparams: dict[str, Any], hparams_name: str | None,
                overrides: dict[str, Any], hparams_type: str | None = None) -> dict[str, Any]:
    """The keyword arguments ``cls(...)`` gets, by Lightning's rule: the saved hyperparameters
    updated with the overrides, passed whole under their argument name when they were one config
    object (``save_hyperparameters(config)``; an OmegaConf ``DictConfig`` again when
    ``hparams_type`` says it was one), else spread; filtered to the ``__init__`` signature unless
    it takes ``**kwargs``."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    loaded: dict[str, Any] = {**hparams, **overrides}
    if hparams_name and hparams_name != "kwargs" and hparams_name in names:
        loaded = {hparams_name: _container(loaded, hparams_type)}
    kwargs = {**loaded, **overrides}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return kwargs


def _container(hparams: dict[str, Any], hparams_type: str | None) -> Any:
    """The saved hyperparameters as the container they were saved from: a ``DictConfig`` when
    that was its type (and omegaconf is installed), else an AttributeDict."""
    if hparams_type == "DictConfig":
        try:
            from omegaconf import OmegaConf

            return OmegaConf.create(hparams)
        except ImportError:
            pass
    return AttributeDict(hparams)


def _device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise ConfigError(f"load_from_checkpoint: map_location={map_location!r}; valid: None (CPU), a device or "
                      "a device name")


def map_tensors(obj: Any, map_location: Any) -> Any:
    """``torch.load``'s ``map_location`` on a checkpoint read to the CPU: None (stay), a device or
    device name, a dict of location names (``{"cpu": "cuda:0"}``), or a function
    ``(storage, "cpu") -> storage or None`` (each tensor goes where its storage was put)."""
    if map_location is None:
        return obj
    if isinstance(map_location, dict):
        return map_tensors(obj, map_location.get("cpu"))
    if not callable(map_location) or isinstance(map_location, torch.device):
        from ..loop.evaluation import to_device

        return to_device(obj, _device(map_location))
    if isinstance(obj, torch.Tensor):
        moved = map_location(obj.untyped_storage(), "cpu")
        return obj if moved is None or moved.device == obj.device else obj.to(moved.device)
    if isinstance(obj, dict):
        return {k: map_tensors(v, map_location) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, map_location) for v in obj)
    return obj


def _hparams_from_file(hparams_file: str | os.PathLike) -> dict[str, Any]:
    """Lightning's ``hparams_file``: the hyperparameters of a ``.yaml``/``.yml`` or tags ``.csv`` file."""
    from .saving import load_hparams_from_tags_csv, load_hparams_from_yaml

    extension = str(hparams_file).rsplit(".", 1)[-1].lower()
    if extension == "csv":
        return dict(load_hparams_from_tags_csv(hparams_file))
    if extension in ("yml", "yaml"):
        return dict(load_hparams_from_yaml(hparams_file, use_omegaconf=False))
    raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")


#: the builders a checkpoint may name (``_instantiator``): importing another path from a checkpoint
#: could run any code
TRUSTED_INSTANTIATORS = frozenset({"zerotrain.cli.instantiate_module"})


def trusted_instantiator(cls: type, hparams: dict[str, Any]) -> Any:
    """The function that rebuilds ``cls`` from ``hparams`` when a ``LightningCLI`` built it
    (``hparams`` names it under ``_instantiator``, popped here), else None. Only
    ``zerotrain.cli.instantiate_module`` is accepted, and a ``_class_path`` must name a subclass
    of ``cls`` already imported: a checkpoint never imports code."""
    path = hparams.pop(INSTANTIATOR_KEY, None)
    if path is None:
        return None
    if path not in TRUSTED_INSTANTIATORS:
        raise ValueError(f"The instantiator {path!r} of the checkpoint is not one of the trusted instantiators "
                         f"{sorted(TRUSTED_INSTANTIATORS)} and was blocked: importing it could run arbitrary code")
    class_path = hparams.get(CLASS_PATH_KEY)
    if class_path is not None:
        where, _, name = str(class_path).rpartition(".")
        target = getattr(sys.modules.get(where), name, None)
        if not (isinstance(target, type) and issubclass(target, cls)):
            raise ValueError(f"The class {class_path!r} requested by the checkpoint is not an imported subclass of "
                             f"{cls.__name__} and was blocked (a checkpoint never imports code): import the module "
                             "that defines it before loading")
    where, _, name = path.rpartition(".")
    return getattr(importlib.import_module(where), name)


def load_from_checkpoint(cls: type, checkpoint_path: str | os.PathLike, map_location: Any = None,
                         strict: bool | None = None, hparams_file: str | os.PathLike | None = None,
                         weights_only: bool | None = None, **overrides: Any) -> Any:
    """``TrainModule.load_from_checkpoint`` and ``DataModule.load_from_checkpoint`` (see the module
    docstring): the class's hyperparameters (``cls.CHECKPOINT_HYPER_PARAMS_KEY``; those of
    ``hparams_file`` instead when given) updated with ``overrides``. ``weights_only`` is accepted
    for Lightning's signature: zerotrain always reads a checkpoint weights-only."""
    from .module import TrainModule

    checkpoint = read_checkpoint(checkpoint_path)
    checkpoint["state_dict"] = map_tensors(checkpoint.get("state_dict", {}), map_location)
    key = getattr(cls, "CHECKPOINT_HYPER_PARAMS_KEY", HPARAMS_KEY)
    if hparams_file is not None:
        checkpoint[key] = _hparams_from_file(hparams_file)
    hparams = {}
    if issubclass(cls, TrainModule):  # as Lightning: a module's hyperparameters under older keys first
        for past in PAST_HPARAMS_KEYS:
            hparams.update(checkpoint.get(past) or {})
    hparams.update(checkpoint.get(key) or {})
    checkpoint[key] = {**hparams, **overrides}
    hparams_name = checkpoint.get(getattr(cls, "CHECKPOINT_HYPER_PARAMS_NAME", HPARAMS_NAME_KEY))
    hparams_type = checkpoint.get(getattr(cls, "CHECKPOINT_HYPER_PARAMS_TYPE", "hparams_type"))
    instantiator = trusted_instantiator(cls, hparams)
    try:
        if instantiator is not None and CLASS_PATH_KEY in hparams:  # the subclass's own arguments: its parser checks
            module = instantiator(cls, {**hparams, **overrides})
        elif instantiator is not None:
            module = instantiator(cls, init_kwargs(cls, hparams, hparams_name, overrides, hparams_type))
        else:
            module = cls(**init_kwargs(cls, hparams, hparams_name, overrides, hparams_type))
    except TypeError as exc:  # Lightning's TypeError itself first, then where it came from
        raise TypeError(f"{exc} ({cls.__name__}.load_from_checkpoint({str(checkpoint_path)!r}): building the "
                        f"module from the saved hyperparameters {sorted(hparams)} failed; pass the missing "
                        "arguments as keyword overrides)") from exc
    if not isinstance(module, TrainModule):  # a DataModule: its own state, when it saved one
        if type(module).__qualname__ in checkpoint and hasattr(module, "load_state_dict"):
            module.load_state_dict(checkpoint[type(module).__qualname__])
        return module
    if type(module).configure_model is not TrainModule.configure_model:
        module.configure_model()
    module.on_load_checkpoint(checkpoint)
    given = getattr(module, "_strict_loading", None)  # Lightning's: `strict` and `strict_loading` must agree
    if given is not None and strict is not None and strict != module.strict_loading:
        raise ValueError(f"You set `.load_from_checkpoint(..., strict={strict!r})` which is in conflict with "
                         f"`{cls.__name__}.strict_loading={module.strict_loading!r}. Please set the same value for "
                         "both of them.")
    strict = module.strict_loading if strict is None else strict
    keys = module.load_state_dict(checkpoint["state_dict"], strict=strict)
    if not strict and keys and keys.missing_keys:
        log.warning("Found keys that are in the model state dict but not in the checkpoint: %s", keys.missing_keys)
    if not strict and keys and keys.unexpected_keys:
        log.warning("Found keys that are not in the model state dict but in the checkpoint: %s", keys.unexpected_keys)
    state = checkpoint["state_dict"]
    if not state:
        warnings.warn(f"The state dict in {str(checkpoint_path)!r} contains no parameters.", UserWarning, stacklevel=3)
        return module
    first = next((t for t in state.values() if isinstance(t, torch.Tensor)), None)
    return module.to(first.device) if first is not None else module  # Lightning's: where the weights are
