"""Several ``engine.backward`` calls per step at fp32 ZeRO stage 1, two gloo ranks, against
DeepSpeed 0.19.8 itself (``DS_ACCELERATOR=cpu``): the loops of DeepSpeedExamples'
``training/gan/gan_deepspeed_train.py`` and their variants, two engines (a discriminator D and a
generator G, torch Adam passed in), the modules called directly as the example does.

DeepSpeed's stage 1 reduces at the end of each of its own engine's backwards at the accumulation
boundary and *replaces* the gradient the step uses (the GAN's D steps on its fake batch alone);
G's backward through D only accumulates into D's ``p.grad``. zerotrain refused the second
gradient ("received its gradient twice") before ``last_backward_wins``
(``strategies/zero/stage1.py``). Cases:

* ``gan``: the example's order: D.zero_grad, D(real), D(fake), D.step, G through D, G.step;
* ``late_step``: D's step after G's backward (what G left on D must not reach D's step), no zero_grad;
* ``foreign_first``: G through D first, then one D backward: D's step includes G's gradient;
* ``gan_gas2``: ``gan`` with ``gradient_accumulation_steps`` 2 (the first micro-batch accumulates);
* ``direct_gas2``: one D backward per micro-batch, accumulation 2, D called directly (not through
  the engine's forward): the first micro-batch's backward must defer its reduction to the boundary.

Exact equality is the derived bound: both libraries sum the same two per-rank gradients (an
all-reduce of two ranks is one addition) and divide by 2, and step torch's Adam on the same values;
no clipping (DeepSpeed's ZeRO 1-3 clip norm sums in another order, bench/CONFORMANCE.md issue 45).
Compared: every loss of both ranks, and both models' final weights. Skipped without deepspeed.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import needs
from harness import run_ranks

pytestmark = [needs.deepspeed, pytest.mark.timeout(600),
              # both libraries in 2 processes each (~60 s): the default suite keeps
              # tests/unit/test_deepspeed_zero1_backwards.py (one process, zerotrain only)
              pytest.mark.slow]

CASES = ["gan", "late_step", "foreign_first", "gan_gas2", "direct_gas2"]
STEPS = 4
MICRO = 4


def _config(gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1}, "steps_per_print": 1000}


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    g = nn.Sequential(nn.Linear(3, 6), nn.Tanh())
    return d, g


def _train(impl: str, cases: list[str]) -> dict:
    ds = importlib.import_module("deepspeed" if impl == "ds" else "zerotrain.deepspeed")
    import torch.distributed as dist

    ds.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out = {}
    for case in cases:
        d, g = _models()
        gas = 2 if case.endswith("gas2") else 1
        config = _config(gas)
        engines = []
        for m in (d, g):
            opt = torch.optim.Adam(m.parameters(), lr=0.05, betas=(0.5, 0.999))
            engines.append(ds.initialize(model=m, model_parameters=m.parameters(), optimizer=opt, config=config)[0])
        engine_d, engine_g = engines
        gen = torch.Generator().manual_seed(10 + rank)
        ones, zeros = torch.ones(MICRO, 1), torch.zeros(MICRO, 1)
        losses = []
        for _ in range(STEPS * gas):
            real, z = torch.randn(MICRO, 6, generator=gen), torch.randn(MICRO, 3, generator=gen)
            if case in ("gan", "gan_gas2"):
                d.zero_grad()
            if case == "direct_gas2":
                err_real = F.mse_loss(d(real), ones)
                engine_d.backward(err_real)
                engine_d.step()
                losses.append(err_real.item())
                continue
            if case == "foreign_first":
                err_g = F.mse_loss(d(g(z)), ones)
                engine_g.backward(err_g)
                engine_g.step()
                err_real = F.mse_loss(d(real), zeros)
                engine_d.backward(err_real)
                engine_d.step()
                losses += [err_g.item(), err_real.item()]
                continue
            err_real = F.mse_loss(d(real), ones)
            engine_d.backward(err_real)
            fake = g(z)
            err_fake = F.mse_loss(d(fake.detach()), zeros)
            engine_d.backward(err_fake)
            if case != "late_step":
                engine_d.step()
            err_g = F.mse_loss(d(fake), ones)
            engine_g.backward(err_g)
            if case == "late_step":
                engine_d.step()
            engine_g.step()
            losses += [err_real.item(), err_fake.item(), err_g.item()]
        out[case] = {"losses": losses, "d": [p.detach().clone() for p in d.parameters()],
                     "g": [p.detach().clone() for p in g.parameters()]}
        for e in engines:
            if hasattr(e, "destroy"):
                e.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero1_backwards")
    return {impl: run_ranks("test_deepspeed_zero1_backwards:_train", 2, tmp / impl, timeout=400,
                            env={"DS_ACCELERATOR": "cpu"}, impl=impl, cases=CASES)
            for impl in ("ds", "zt")}


@pytest.mark.parametrize("case", CASES)
def test_two_backwards_per_step_at_stage1_as_deepspeed(runs, case):
    for rank in range(2):
        want, got = runs["ds"][rank][case], runs["zt"][rank][case]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        for model in ("d", "g"):
            for i, (a, b) in enumerate(zip(got[model], want[model])):
                assert torch.equal(a, b), (rank, model, i, (a - b).abs().max())
