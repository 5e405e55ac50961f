"""Lightning's batch transfer hooks, around moving each batch to the rank's device:
``on_before_batch_transfer(batch, dataloader_idx)``, ``transfer_batch_to_device(batch, device,
dataloader_idx)`` (by default every tensor of the batch moved), ``on_after_batch_transfer(batch,
dataloader_idx)``; each the datamodule's where it overrides it, else the module's, as Lightning's.
Then the precision converts the batch's floating-point inputs (``Precision.convert_input``)."""
from __future__ import annotations

from typing import Any

from ..api.datamodule import overrides_hook
from ..loop.hooks import datamodule_hook

_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def transfer_batch(trainer: Any, batch: Any, dataloader_idx: int = 0) -> Any:
    s, dm, module = trainer.strategy, trainer.datamodule, trainer.module
    for hook in _HOOKS:
        args = (s.device, dataloader_idx) if hook == "transfer_batch_to_device" else (dataloader_idx,)
        if overrides_hook(dm, hook):
            batch = datamodule_hook(trainer, dm, hook, batch, *args)
        else:
            batch = trainer.hooks.module_hook(hook, trainer, module, batch, *args)
    return s.precision.convert_input(batch)
