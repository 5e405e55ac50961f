"""zerotrain.deepspeed at fp32 ZeRO stage 1, in one process: several ``engine.backward`` calls per
step follow DeepSpeed 0.19.8's stage-1 rules (``strategies/zero/stage1.py``, ``last_backward_wins``).

* Each backward at the accumulation boundary reduces what accumulated since the previous one and
  *replaces* the gradient the step will use: ``backward(a); backward(b); step()`` steps on b's
  gradient alone (DeepSpeed's GAN example trains its discriminator this way).
* Another engine's backward that reaches this engine's parameters (a generator's loss through the
  discriminator) only accumulates into them; the next own backward reduces it with its own.

Both comparisons are exact: the runs compared apply the same operations to the same values (one
``p.grad`` holding g_f + g_o, added in either order, which is the same float). The two-rank run
against DeepSpeed itself is tests/distributed/test_deepspeed_zero1_backwards.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerotrain.deepspeed as deepspeed

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)

CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0}


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)), nn.Sequential(nn.Linear(3, 6), nn.Tanh())


def _engine(model: nn.Module) -> deepspeed.DeepSpeedEngine:
    opt = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.5, 0.999))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=opt, config=CONFIG)[0]


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_last_backward_before_the_step_is_what_the_step_uses():
    def run(both: bool) -> torch.Tensor:
        d, _ = _models()
        engine = _engine(d)
        for x, _z in _batches(3):
            if both:  # its gradient is replaced by the next backward's
                engine.backward(F.mse_loss(d(x), torch.ones(4, 1)))
            engine.backward(F.mse_loss(d(x * 2), torch.zeros(4, 1)))
            engine.step()
        return _weights(d)

    assert torch.equal(run(both=True), run(both=False))


def test_another_engines_backward_through_the_parameters_accumulates():
    def run(foreign: bool) -> torch.Tensor:
        d, g = _models()
        engine_d = _engine(d)
        engine_g = _engine(g) if foreign else None
        for x, z in _batches(3):
            if foreign:  # the generator's loss reaches d's parameters: d accumulates it, reduces nothing
                engine_g.backward(F.mse_loss(d(g(z)), torch.ones(4, 1)))  # (g never steps: the same g(z))
                engine_d.backward(F.mse_loss(d(x), torch.zeros(4, 1)))
            else:  # the same gradient of d's parameters from one backward
                engine_d.backward(F.mse_loss(d(g(z).detach()), torch.ones(4, 1)) + F.mse_loss(d(x), torch.zeros(4, 1)))
            engine_d.step()
        return _weights(d)

    assert torch.equal(run(foreign=True), run(foreign=False))
