"""Where a tuner reads and writes a hyperparameter such as ``lr`` or ``batch_size``, by Lightning's
rule (``lightning.pytorch.utilities.parsing``'s ``lightning_hasattr`` / ``getattr`` / ``setattr``):
the module's attribute, its ``hparams``, the Trainer's datamodule's attribute and its ``hparams``;
reading takes the last of those that has it, writing sets every one."""
from __future__ import annotations

from typing import Any


def _holders(model: Any, attribute: str) -> list[Any]:
    found = []
    if hasattr(model, attribute):
        found.append(model)
    hparams = getattr(model, "hparams", None)
    if hparams is not None and attribute in hparams:
        found.append(hparams)
    try:
        trainer = model.trainer
    except RuntimeError:  # not attached to a Trainer
        trainer = None
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    if dm is not None:
        if hasattr(dm, attribute):
            found.append(dm)
        dm_hparams = getattr(dm, "hparams", None)
        if dm_hparams is not None and attribute in dm_hparams:
            found.append(dm_hparams)
    return found


def _missing(attribute: str) -> AttributeError:
    return AttributeError(f"{attribute} is neither stored in the model namespace nor the `hparams` namespace/dict, "
                          "nor the datamodule.")


def lightning_hasattr(model: Any, attribute: str) -> bool:
    return bool(_holders(model, attribute))


def lightning_getattr(model: Any, attribute: str) -> Any:
    holders = _holders(model, attribute)
    if not holders:
        raise _missing(attribute)
    last = holders[-1]
    return last[attribute] if isinstance(last, dict) else getattr(last, attribute)


def lightning_setattr(model: Any, attribute: str, value: Any) -> None:
    holders = _holders(model, attribute)
    if not holders:
        raise _missing(attribute)
    for holder in holders:
        if isinstance(holder, dict):
            holder[attribute] = value
        else:
            setattr(holder, attribute, value)
