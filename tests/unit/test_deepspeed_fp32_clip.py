"""ZeRO stage 0 in fp32 clips as DeepSpeed's engine does (``clip_fp32_gradients``): each
parameter's gradient norm, squared and summed, the root, the coefficient ``min(1, max / (norm +
1e-6))`` on every gradient. torch's ``clip_grad_norm_`` (the norm of the per-parameter norms)
rounds differently in the last bit; DeepSpeedExamples' GAN, which clips every step under DeepSpeed's
default ``gradient_clipping`` 1.0, drifted 1.9e-3 from DeepSpeed in 8 steps (issue 42), and is
identical with this."""
from __future__ import annotations

import torch
from torch import nn

import zerotrain.deepspeed as deepspeed

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture


def _deepspeeds_clip(grads, max_norm):
    """DeepSpeed 0.19.8's arithmetic (runtime/utils.py clip_grad_norm_), one process."""
    total = torch.stack([g.float().norm(2.0) for g in grads]).pow(2.0).sum().float().pow(0.5)
    total = total * 1.0 / 1.0
    coef = torch.min(torch.tensor([1.0]), torch.tensor([float(max_norm)]) / (total + 1e-6))
    return [g * coef for g in grads]


def _torchs_clip(grads, max_norm):
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return [g * torch.clamp(max_norm / (total + 1e-6), max=1.0) for g in grads]


def test_stage0_fp32_clips_in_deepspeeds_arithmetic():
    torch.manual_seed(8)  # a case where the two orders round the norm differently (checked below)
    ref = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    x, y = torch.randn(6, 7), torch.randn(6, 5)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    model.load_state_dict(ref.state_dict())
    nn.functional.mse_loss(ref(x), y).mul(50).backward()
    grads = [p.grad.clone() for p in ref.parameters()]
    want, torchs = _deepspeeds_clip(grads, 0.3), _torchs_clip(grads, 0.3)
    assert any(not torch.equal(a, b) for a, b in zip(want, torchs)), "the two orders must differ for this case"
    before = [p.detach().clone() for p in model.parameters()]
    config = {"train_batch_size": 1, "gradient_clipping": 0.3,
              "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    engine.backward(nn.functional.mse_loss(engine(x), y).mul(50))
    engine.step()
    moved = [b - p.detach() for b, p in zip(before, model.parameters())]  # SGD, lr 1: the clipped gradient
    got = [(b - (b - g)) for b, g in zip(before, want)]
    for m, g in zip(moved, got):
        torch.testing.assert_close(m, g, rtol=0, atol=0)
