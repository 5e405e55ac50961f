"""One process, one device: the base class's replicated defaults with nothing to communicate."""
from __future__ import annotations

from .base import Strategy


class SingleDevice(Strategy):
    name = "single"

    def setup_environment(self) -> None:
        if self.world_size != 1:
            raise ValueError(
                f"strategy='single' runs one process but {self.world_size} were requested; "
                "use strategy='ddp' (or a zero stage) or devices=1")
