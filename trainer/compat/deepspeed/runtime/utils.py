"""``deepspeed.runtime.utils``: the helpers training scripts call themselves."""
from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators with ``seed`` (DeepSpeed's helper: scripts call
    it before building a model, so every rank builds the same weights)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["set_random_seed"]
