"""``trainer._accelerator_connector``: the attributes of Lightning's accelerator connector that
code written for Lightning reads from a Trainer (``is_distributed`` above all, e.g. in a
``BasePredictionWriter`` deciding how many samples a rank sees). A read-only view of the
Trainer's own choices; not Lightning's connector: it chooses nothing."""
from __future__ import annotations

from typing import Any


class AcceleratorConnectorView:
    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    @property
    def strategy(self) -> Any:
        return self._trainer.strategy

    @property
    def accelerator(self) -> Any:
        return self._trainer.accelerator

    @property
    def is_distributed(self) -> bool:
        """Lightning's rule: a data-parallel or sharding strategy (DDP, ZeRO, ...) is distributed even
        on one device; only the single-device strategy is not."""
        from ....strategies import SingleDevice

        return not isinstance(self._trainer.strategy, SingleDevice)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strategy={self.strategy!r}, is_distributed={self.is_distributed})"
