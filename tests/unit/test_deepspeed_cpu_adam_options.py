"""The DeepSpeed face's ``DeepSpeedCPUAdam`` options refused where they cannot run, at construction
(before a step): float16 moments, which the host kernel does not keep."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain


def test_cpu_adam_refuses_float16_moments_at_construction():
    from zerotrain.deepspeed.ops.adam import DeepSpeedCPUAdam

    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(zerotrain.ConfigError, match=r"^DeepSpeedCPUAdam: fp32_optimizer_states=False with float16 "):
        DeepSpeedCPUAdam([half], fp32_optimizer_states=False)
    DeepSpeedCPUAdam([half])  # fp32 moments: fine
    DeepSpeedCPUAdam([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], fp32_optimizer_states=False)
