"""bf16 at ZeRO stage 0 under the DeepSpeed face: DeepSpeed 0.19.8 wraps the optimizer in its 16-bit
optimizer there (``FP16_Optimizer`` around its FusedAdam, ``FP16_UnfusedOptimizer`` around any
other), which steps the optimizer once on zero gradients at set-up, clips by its own norm
(``clip = (norm + 1e-6) / max``, gradients times ``1 / clip`` when above 1) and, fused, steps one
flat fp32 master per param group in one host-kernel call. zerotrain stepped each tensor on its own,
from step 1, clipped as torch does: DeepSpeedExamples' cifar in bf16 at stage 0 was one bf16 ulp
apart from step 15 (bench/CONFORMANCE.md). The comparison with DeepSpeed itself on 2 ranks is
tests/distributed/test_deepspeed_stage0_bf16.py (slow); here, one process, the arithmetic as read
from DeepSpeed's source, written out step by step: exact equality (the same operations on the same
operands)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.ops import fused_adam_step
from zerotrain.ops.deepspeed_adam import DeepSpeedBetaPowers

from deepspeed_unit_common import BASE, _own_group_and_checkpointing  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)

LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.8, 0.999), 1e-8, 0.05
# 336 + 21 + 105 + 5 = 467 elements: per-tensor kernel calls put the kernel's scalar tail
# (numel % 16) on other elements than one call over the flat buffer
CONFIG = {**BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "gradient_clipping": CLIP,
          "optimizer": {"type": "Adam", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 21), nn.Tanh(), nn.Linear(21, 5))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 16, generator=g), torch.randn(2, 5, generator=g)) for _ in range(n)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def _reference(steps: int) -> tuple[list[float], torch.Tensor]:
    """FP16_Optimizer around FusedAdam (AdamW mode) on the CPU accelerator, written out."""
    model = _model()
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.copy_(p.bfloat16())  # the module cast to bf16 before the masters are copied
    master = torch.cat([p.detach().reshape(-1) for p in params])
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    powers = DeepSpeedBetaPowers()

    def kernel(grad: torch.Tensor, step: int) -> None:
        fused_adam_step(master, grad, m, v, step=step, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                        weight_decay=WD, adamw=True, order="deepspeed", beta_powers=powers.advance(step, *BETAS))

    kernel(torch.zeros_like(master), 1)  # initialize_optimizer_states: one step on zero gradients
    losses = []
    for i, (x, y) in enumerate(_batches(steps)):
        at = 0
        with torch.no_grad():
            for p in params:
                p.copy_(master[at:at + p.numel()].view_as(p))
                at += p.numel()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 module's forward
            out = model(x.bfloat16())
        loss = _loss(out, y)
        loss.backward()
        losses.append(loss.item())
        grad = torch.cat([p.grad.reshape(-1).float() for p in params])
        total = grad.norm(2.0).item() ** 2.0
        norm = torch.tensor([total], dtype=torch.float32)[0].item() ** 0.5
        norm = math.sqrt(norm ** 2.0)
        clip = (norm + 1e-6) / CLIP
        if clip > 1:
            grad.mul_(1.0 / clip)
        kernel(grad, i + 2)
    return losses, master


def _train(config: dict, steps: int) -> tuple[list[float], torch.Tensor, object]:
    model = _model()
    engine, opt, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for x, y in _batches(steps):
        loss = _loss(engine(x.bfloat16()), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()]), engine


def test_stage0_bf16_steps_as_deepspeeds_fused_16bit_optimizer():
    want_losses, want = _reference(4)
    losses, got, _ = _train(CONFIG, 4)
    assert losses == want_losses
    assert torch.equal(got, want), (got - want).abs().max().item()


def test_the_fused_wrapper_keeps_each_group_in_one_buffer_and_steps_once_at_setup():
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    params = list(engine.module.parameters())
    base = params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in params)
    inner = engine.sixteen_bit.optimizer
    assert all(int(inner.state[p]["step"].item()) == 1 for p in params)
    # a loaded optimizer state (separate tensors) is gathered into one buffer again at the next step
    state = inner.state_dict()
    state["state"] = {k: {n: t.clone() for n, t in s.items()} for k, s in state["state"].items()}
    inner.load_state_dict(state)
    x, y = _batches(1)[0]
    engine.backward(_loss(engine(x.bfloat16()), y))
    engine.step()
    moments = [inner.state[p]["exp_avg"] for p in params]
    assert all(t.untyped_storage().data_ptr() == moments[0].untyped_storage().data_ptr() for t in moments)
    assert all(int(inner.state[p]["step"].item()) == 2 for p in params)


def test_the_unfused_wrapper_steps_a_torch_optimizer_once_on_zero_gradients():
    """``torch_adam``: DeepSpeed's unfused wrapper around torch's AdamW also takes the zero-gradient
    step: the step count is one ahead and the decay ``p * (1 - lr * wd)`` applied once."""
    params = dict(CONFIG["optimizer"]["params"], torch_adam=True)
    model = _model()
    rounded = [p.detach().bfloat16().float() for p in model.parameters()]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**CONFIG, "optimizer": {"type": "Adam", "params": params}})
    inner = engine.sixteen_bit.optimizer
    assert not engine.sixteen_bit.fused and type(inner) is torch.optim.AdamW
    for p, r in zip(engine.module.parameters(), rounded):
        assert int(inner.state[p]["step"].item()) == 1
        assert torch.equal(p.detach(), r.mul(1 - LR * WD))


def test_other_configs_keep_zerotrains_step():
    for keys in ({"bf16": {"enabled": False}}, {"zero_optimization": {"stage": 1}}):
        model = _model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={**CONFIG, **keys})
        assert engine.sixteen_bit is None
        torch.distributed.destroy_process_group()


class _Embedded(nn.Module):
    """Ops autocast leaves alone (an embedding, a LayerNorm, a parameter in plain arithmetic) and
    a floating buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 5)
        self.gain = nn.Parameter(torch.rand(16) + 0.5)
        self.register_buffer("shift", torch.rand(16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids) * self.gain + self.shift))


def test_the_forward_sees_the_bf16_module_deepspeed_trains():
    """DeepSpeed's stage-0 module is bf16 (parameters and buffers): its forward equals this model
    cast to bf16, whatever the ops; zerotrain's fp32 parameters under autocast gave an embedding, a
    LayerNorm and a plain product their fp32 weights."""
    import copy

    torch.manual_seed(0)
    model = _Embedded()
    ds_module = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(0, 50, (2, 7))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={**CONFIG, "optimizer": {"type": "Adam", "params": {"lr": 0.0}}})
    with torch.no_grad():
        want = ds_module(ids)
    out = engine(ids)
    assert out.dtype == torch.bfloat16 and torch.equal(out.detach(), want)
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())  # the masters, back after the forward
    engine.backward(out.float().pow(2).mean())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in engine.module.parameters())
