"""What the zerotrain.deepspeed unit tests share: the smallest config, its parser, and an autouse
fixture that undoes what ``initialize`` and ``checkpointing.configure`` leave behind (a test
module imports the fixture by name for pytest to use it)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from zerotrain.deepspeed import checkpointing
from zerotrain.deepspeed.config import parse

BASE = {"train_micro_batch_size_per_gpu": 2}


@pytest.fixture(autouse=True)
def _own_group_and_checkpointing(monkeypatch):
    """``initialize`` makes a process group of one here (as DeepSpeed does for a process started
    without a launcher): each test lets go of the group it made. ``checkpointing.configure`` sets
    module-wide options: each test gets them back as they were."""
    monkeypatch.setattr(checkpointing, "_settings", checkpointing._settings)
    monkeypatch.setattr(checkpointing, "_configured", checkpointing._configured)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def cfg(world: int = 1, **keys):
    return parse({**BASE, **keys}, world)
