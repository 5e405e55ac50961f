"""``hparams.yaml`` read and written as Lightning's ``lightning.pytorch.core.saving`` does
(``zerotrain.core.saving``): the loggers write it, ``load_hparams_from_yaml`` reads it back."""
from __future__ import annotations

import os
import warnings
from argparse import Namespace
from typing import Any


def save_hparams_to_yaml(config_yaml: "str | os.PathLike", hparams: Any, use_omegaconf: bool = True) -> None:
    """Write ``hparams`` (a dict, Namespace or OmegaConf container) to ``config_yaml``; a value
    YAML cannot write is left out with a warning. The folder must exist."""
    import yaml

    folder = os.path.dirname(os.fspath(config_yaml))
    if folder and not os.path.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}.")
    if isinstance(hparams, Namespace):
        hparams = vars(hparams)
    if use_omegaconf:
        try:
            from omegaconf import Container, OmegaConf

            if isinstance(hparams, Container):
                OmegaConf.save(hparams, config_yaml, resolve=True)
                return
        except ImportError:
            pass
    if not isinstance(hparams, dict):
        raise TypeError("hparams must be dictionary")
    kept = {}
    for key, value in dict(hparams).items():
        try:
            yaml.dump(value)
        except Exception:  # noqa: BLE001 - yaml raises many kinds
            warnings.warn(f"Skipping '{key}' parameter because it is not possible to safely dump to YAML.",
                          stacklevel=2)
            continue
        kept[key] = value
    with open(config_yaml, "w", newline="") as f:
        yaml.dump(kept, f, sort_keys=False)


def load_hparams_from_yaml(config_yaml: "str | os.PathLike", use_omegaconf: bool = True) -> Any:
    """The hyperparameters in ``config_yaml`` ({} with a warning when the file is missing), as an
    OmegaConf ``DictConfig`` when omegaconf is installed and ``use_omegaconf``."""
    import yaml

    if not os.path.isfile(config_yaml):
        warnings.warn(f"Missing Tags: {config_yaml}.", stacklevel=2)
        return {}
    with open(config_yaml) as f:
        hparams = yaml.full_load(f)
    if use_omegaconf:
        try:
            from omegaconf import OmegaConf

            return OmegaConf.create(hparams)
        except ImportError:
            pass
    return hparams
