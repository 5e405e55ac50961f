"""One process, one device: the base class's replicated defaults with nothing to communicate."""
from __future__ import annotations

from .base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"
    inference_mode_evaluation = True
    supports_float64 = True
    evaluates_without_optimizer = True

    def check_world_size(self, world_size: int) -> None:
        self.check_mesh(world_size)
        if world_size != 1:
            raise ValueError(
                f"strategy='single' runs one process but {world_size} were requested; "
                "use strategy='ddp' (or a zero stage) or devices=1")

    def setup_environment(self) -> None:
        self.check_world_size(self.world_size)


#: zerotrain's short name for the same class (its own name is Lightning's)
SingleDevice = SingleDeviceStrategy
