"""Lightning's ``Tuner`` (``lightning.pytorch.tuner.tuning``): its learning-rate finder and
batch-size scaler are not in zerotrain (``python3 tune.py`` searches strategies, micro-batches
and bucket sizes instead); the class exists so that code importing it loads, and each method
raises ``NotImplementedError`` saying so."""
from __future__ import annotations

from typing import Any


class Tuner:
    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def scale_batch_size(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Tuner.scale_batch_size: zerotrain has no batch-size finder (Lightning's); "
                                  "tune.py searches micro-batch sizes that fit memory")

    def lr_find(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Tuner.lr_find: zerotrain has no learning-rate finder (Lightning's)")
