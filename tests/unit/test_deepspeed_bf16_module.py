"""zerotrain.deepspeed's bf16 at ZeRO stages 1-3, in one process: the model's forward sees what
DeepSpeed 0.19.8's cast module holds (every parameter bf16, the trainable and the frozen ones;
buffers in their own type) and runs without autocast, so LayerNorm and ``cross_entropy`` compute
and return bf16. Stage 0 keeps its autocast (``ops/sixteen_bit.py``), and so does zerotrain's own
"bf16-mixed". The comparison with DeepSpeed itself, two ranks: tests/distributed/test_deepspeed_bf16_module.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.strategies.precision import precision_from_name

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture


class _Probe(nn.Module):
    """Records, at each forward, the dtypes the forward works with."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8)
        self.frozen = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.1))
        self.seen: list[dict] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids) + self.shift.to(self.emb.weight.dtype))
        h = h + self.frozen(h)
        loss = F.cross_entropy(self.head(h).view(-1, 8), ids.view(-1))
        self.seen.append({"params": {p.dtype for p in self.parameters()}, "buffer": self.shift.dtype,
                          "autocast": torch.is_autocast_enabled("cpu"), "ln": h.dtype, "loss": loss.dtype})
        return loss


def _run(stage: int) -> list[dict]:
    torch.manual_seed(0)
    net = _Probe()
    net.frozen.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                      config=config)
    ids = torch.randint(0, 8, (2, 3), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(ids)
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return net.seen


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_bf16_forward_sees_deepspeeds_bf16_module(stage):
    for seen in _run(stage):
        assert seen == {"params": {torch.bfloat16}, "buffer": torch.float32, "autocast": False,
                        "ln": torch.bfloat16, "loss": torch.bfloat16}, seen


def test_stage0_and_zerotrains_bf16_mixed_keep_autocast():
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=nn.Linear(4, 2), config=config)
    assert engine.zerotrain_engine.strategy.precision.autocast_dtype == torch.bfloat16
    engine.destroy()
    assert precision_from_name("bf16-mixed").autocast_dtype == torch.bfloat16
