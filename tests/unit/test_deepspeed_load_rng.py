"""``engine.load_checkpoint`` leaves the random generators as they are, as DeepSpeed's does
(its engine checkpoints hold no generator state). zerotrain's checkpoint restores the saved
generators on a Trainer/Engine resume; through the DeepSpeed face it did too, so a script that
seeds and then loads (DeepSpeedExamples' HelloDeepSpeed train_bert_ds.py) drew other dropout masks
than under DeepSpeed after resuming: 7.6e-3 apart at the first resumed step (issue 42), identical with this."""
from __future__ import annotations

import random

import torch
from torch import nn

import zerotrain.deepspeed as deepspeed

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture


def test_load_checkpoint_keeps_the_scripts_random_streams(tmp_path):
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepspeed.initialize(model=nn.Linear(3, 3), config=config)[0]
    torch.manual_seed(1)
    random.seed(1)
    engine.save_checkpoint(tmp_path)  # the generators' states at this point are not what load gives back
    torch.manual_seed(123)
    random.seed(123)
    want = (torch.rand(4), random.random())
    torch.manual_seed(123)
    random.seed(123)
    path, client = engine.load_checkpoint(tmp_path)
    assert path is not None and client == {}
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
