"""DeepSpeed 0.19.8's ZeRO-3 replaces ``torch.nn.functional.linear`` with its own autograd function
(``zero_optimization.memory_efficient_linear``, default true): the bias added to the rounded product
of a 3-D input, the weight's gradient one product over the flattened leading dimensions. In bf16 it
rounds otherwise than torch's fused linear, so DeepSpeed's stage 3 trains on other gradients than its
stages 1/2 (DeepSpeedExamples' bf16_master_weight: bench/CONFORMANCE.md). The face's stage-3 engine
runs its forward with zerotrain's own such function (zero_init.Stage3Linear): the same outputs and
gradients as DeepSpeed's, bit for bit (the same operations on the same operands), when deepspeed is
installed; the engine uses it at stage 3 only, and not with the key false."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.trainer.compat.deepspeed.zero_init import stage3_linear

from deepspeed_unit_common import BASE, _own_group_and_checkpointing  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)


def _operands(shape, bias=True, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 48, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(40, 48, generator=g) / 7).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_() if bias else None
    up = torch.randn(*shape, 40, generator=g).to(dtype)
    return x, w, b, up


def _run(fn, shape, bias=True, dtype=torch.bfloat16):
    x, w, b, up = _operands(shape, bias, dtype)
    out = fn(x, w, b)
    out.backward(up)
    return [out.detach()] + [t.grad for t in (x, w, b) if t is not None]


@pytest.mark.parametrize("shape,bias", [((4, 16), True), ((4, 16), False), ((24,), True), ((), True)],
                         ids=["3d", "3d-no-bias", "2d", "1d"])
def test_stage3_linear_is_deepspeeds(shape, bias, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    linear = pytest.importorskip("deepspeed.runtime.zero.linear")
    got, want = _run(stage3_linear, shape, bias), _run(linear.zero3_linear_wrap, shape, bias)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_it_is_not_torchs_linear_in_bf16():
    """What the face ran before: torch's linear on the same bf16 operands parts from it."""
    got, torchs = _run(stage3_linear, (4, 16)), _run(F.linear, (4, 16))
    assert any(not torch.equal(a, b) for a, b in zip(got, torchs))
    fp32 = [_run(fn, (4, 16), dtype=torch.float32) for fn in (stage3_linear, F.linear)]
    for a, b in zip(*fp32):  # the same function: fp32 products agree to rounding
        torch.testing.assert_close(a, b)


class _Probe(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 8), nn.Linear(8, 2)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:  # the user's non-reentrant checkpoint: recomputed inside backward
            h = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=False)
        else:
            h = self.lin(x)
        return self.out(torch.tanh(h))


def _grad_fn(t) -> str:
    """The node that made ``t``, under the stage-3 engine's module boundaries (identities)."""
    fn = t.grad_fn
    while type(fn).__name__.startswith("ModuleBoundary"):
        fn = fn.next_functions[0][0]
    return type(fn).__name__


@pytest.mark.parametrize("zero,used", [({"stage": 3}, True), ({"stage": 2}, False),
                                       ({"stage": 3, "memory_efficient_linear": False}, False)])
def test_the_stage3_engine_forward_uses_it(zero, used):
    torch.manual_seed(0)
    config = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": zero}
    engine, *_ = deepspeed.initialize(model=_Probe(), config=config)
    out = engine(torch.randn(2, 4))
    assert _grad_fn(out).startswith("Stage3Linear") is used
    assert not _grad_fn(nn.Linear(4, 2)(torch.randn(2, 4))).startswith("Stage3Linear")  # other models: torch's


def test_a_slice_of_a_stage3_weight_uses_it_too():
    """DeepSpeed swaps ``F.linear`` itself, so a layer that slices its weight (``nn.MultiheadAttention``
    projecting query, key and value separately: ``in_proj_weight.chunk(3)``) runs its linear too."""
    config = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    model = nn.MultiheadAttention(8, 2)
    deepspeed.initialize(model=model, config=config)
    w = model.in_proj_weight.detach().clone().requires_grad_()  # gathered here: a parameter's slice below
    with deepspeed.zero.GatheredParameters([model.in_proj_weight]):
        out = F.linear(torch.randn(3, 8), model.in_proj_weight.chunk(3)[1])
    assert _grad_fn(out).startswith("Stage3Linear")
    assert not _grad_fn(F.linear(torch.randn(3, 8), w.chunk(3)[1])).startswith("Stage3Linear")  # not its parameter


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x)[0] + x


@pytest.mark.parametrize("stage,distinct", [(3, True), (2, False)])
def test_the_stage3_engine_gives_each_module_argument_its_own_tensor(stage, distinct):
    """DeepSpeed's stage 3 puts an autograd identity on each tensor a module takes and returns (its
    parameter hooks), so ``attention(x, x, x)`` gets three tensors and projects them separately;
    the face's stage-3 engine does the same (``zero_init.use_module_boundaries``), other stages not."""
    config = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    model = _SelfAttention()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    seen = []
    model.attention.register_forward_pre_hook(lambda m, args: seen.append(args[0] is args[1] or args[1] is args[2]))
    engine(torch.randn(2, 3, 8)).sum().backward()
    assert seen == [not distinct]


def test_a_checkpoint_recomputed_in_backward_uses_it_too():
    """A non-reentrant activation checkpoint recomputes its layers inside ``loss.backward()``,
    outside the engine's forward: they must run the same linear as the forward did (else torch's
    checkpoint finds other saved tensors), and the step equals the one without the checkpoint."""
    config = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    x = torch.randn(2, 4)
    losses = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        engine, *_ = deepspeed.initialize(model=_Probe(checkpointed), config=config)
        for _ in range(2):
            loss = engine(x).pow(2).mean()
            loss.backward()
            engine.step()
            losses.append(loss.item())
    assert losses[:2] == losses[2:]



def test_other_models_still_script_after_a_stage3_engine():
    """The swapped ``F.linear`` is what TorchScript compiles for any ``nn.Linear`` of the process
    (Lightning's ``to_torchscript`` of another model after a stage-3 engine): it scripts to torch's op."""
    config = {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 3}}
    deepspeed.initialize(model=_Probe(), config=config)
    other = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    assert torch.equal(torch.jit.script(other)(x), other(x))
