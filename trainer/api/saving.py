"""``hparams.yaml`` read and written as Lightning's ``lightning.pytorch.core.saving`` does
(``zerotrain.core.saving``): the loggers write it, ``load_hparams_from_yaml`` reads it back; and
the older ``key,value`` CSV form (``save_hparams_to_tags_csv`` / ``load_hparams_from_tags_csv``)."""
from __future__ import annotations

import ast
import csv
import os
import warnings
from argparse import Namespace
from enum import Enum
from typing import Any

from ..checkpoint import fs


def save_hparams_to_yaml(config_yaml: "str | os.PathLike", hparams: Any, use_omegaconf: bool = True) -> None:
    """Write ``hparams`` (a dict, Namespace or OmegaConf container) to ``config_yaml``; an Enum
    value as its name, a value YAML cannot write left out with a warning. The folder must exist."""
    import yaml

    folder = os.path.dirname(os.fspath(config_yaml))
    if folder and not fs.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}.")
    if isinstance(hparams, Namespace):
        hparams = vars(hparams)
    if use_omegaconf:
        try:
            from omegaconf import Container, OmegaConf

            if isinstance(hparams, Container):
                with fs.open_file(config_yaml, "w", encoding="utf-8") as f:
                    f.write(OmegaConf.to_yaml(hparams, resolve=True))
                return
        except ImportError:
            pass
    if not isinstance(hparams, dict):
        raise TypeError("hparams must be dictionary")
    kept = {}
    for key, value in dict(hparams).items():
        value = value.name if isinstance(value, Enum) else value  # as Lightning: an Enum by its name
        try:
            yaml.dump(value)
        except Exception:  # noqa: BLE001 - yaml raises many kinds
            warnings.warn(f"Skipping '{key}' parameter because it is not possible to safely dump to YAML.",
                          stacklevel=2)
            continue
        kept[key] = value
    with fs.open_file(config_yaml, "w", newline="") as f:
        yaml.dump(kept, f, sort_keys=False)


def load_hparams_from_yaml(config_yaml: "str | os.PathLike", use_omegaconf: bool = True) -> Any:
    """The hyperparameters in ``config_yaml`` ({} with a warning when the file is missing), as an
    OmegaConf ``DictConfig`` when omegaconf is installed, ``use_omegaconf`` and it can hold them."""
    import yaml

    if not fs.isfile(config_yaml):
        warnings.warn(f"Missing Tags: {config_yaml}.", stacklevel=2)
        return {}
    with fs.open_file(config_yaml) as f:
        hparams = yaml.full_load(f)
    if use_omegaconf:
        try:
            from omegaconf import OmegaConf
            from omegaconf.errors import UnsupportedValueType, ValidationError
        except ImportError:
            return hparams
        try:
            return OmegaConf.create(hparams)
        except (UnsupportedValueType, ValidationError):  # a value OmegaConf cannot hold: the plain dict
            pass
    return hparams


def save_hparams_to_tags_csv(tags_csv: "str | os.PathLike", hparams: Any) -> None:
    """Write ``hparams`` (a dict or Namespace) to ``tags_csv`` as a ``key,value`` header and one row
    per hyperparameter. The folder must exist."""
    folder = os.path.dirname(os.fspath(tags_csv))
    if folder and not os.path.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}.")
    if isinstance(hparams, Namespace):
        hparams = vars(hparams)
    with open(tags_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "value"])
        writer.writerows([key, value] for key, value in hparams.items())


def load_hparams_from_tags_csv(tags_csv: "str | os.PathLike") -> dict[str, Any]:
    """The hyperparameters in a ``key,value`` CSV ({} with a RuntimeWarning when the file is
    missing); each value a Python literal where it reads as one (``32`` an int), else the string."""
    if not os.path.isfile(tags_csv):
        warnings.warn(f"Missing Tags: {tags_csv}.", RuntimeWarning, stacklevel=2)
        return {}
    with open(tags_csv, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return {row[0]: _literal(row[1]) for row in rows}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
