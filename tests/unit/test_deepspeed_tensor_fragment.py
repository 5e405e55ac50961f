"""``zerotrain.deepspeed.utils``' tensor-fragment accessors in one process (issue 42:
``safe_get_full_grad`` and its siblings, used by DeepSpeed's ``test_no_sync_ctxt`` and
``test_zero_tensor_fragment`` and by training scripts): what they return at each ZeRO stage, when
the gradients are readable, what the setters change, and the edge cases DeepSpeed 0.19.8 answers
(an unknown optimizer-state key, a frozen parameter, a tensor no engine trains, the local API
outside ZeRO-3). tests/distributed/test_deepspeed_tensor_fragment.py compares the values with
DeepSpeed's on 2 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.deepspeed import utils

from deepspeed_unit_common import _own_group_and_checkpointing  # noqa: F401 - autouse fixture
from tolerance import EPS32


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.frozen(x))))


def _engine(stage: int, optimizer: dict | None = None):
    torch.manual_seed(0)
    model = _Net()
    reference = _Net()
    reference.load_state_dict(model.state_dict())
    config = {"train_micro_batch_size_per_gpu": 3, "steps_per_print": 1000, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True,
              "optimizer": optimizer or {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=config)[0]
    return engine, reference


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)


def _backward(engine):
    x, y = _batch()
    engine.backward(F.mse_loss(engine(x), y))


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_master_and_gradient_under_zero(stage):
    engine, reference = _engine(stage)
    x, y = _batch()
    F.mse_loss(reference(x), y).backward()
    want = dict(reference.named_parameters())
    for n, p in _trainable(engine):  # before any step: the masters are the initial weights
        assert torch.equal(utils.safe_get_full_fp32_param(p), want[n].detach())
    _backward(engine)
    for n, p in _trainable(engine):
        got = utils.safe_get_full_grad(p)
        assert got.dtype == torch.float32 and got.shape == p.shape
        # tolerance: the same gradient from another kernel (stage 3 computes Linear with its own
        # function): fp32 rounding over the longest reduction (3 samples x 6 features), relative
        torch.testing.assert_close(got, want[n].grad, rtol=EPS32 * 18, atol=EPS32 * 18 * want[n].grad.abs().max().item())
    engine.step()
    for n, p in _trainable(engine):
        master = utils.safe_get_full_fp32_param(p)
        assert master.shape == p.shape and master.dtype == torch.float32
        assert not torch.equal(master, want[n].detach())  # the step moved it
        for key in ("exp_avg", "exp_avg_sq"):
            assert utils.safe_get_full_optimizer_state(p, key).shape == p.shape
    engine.destroy()


def test_stage0_has_no_separate_master_and_reads_dot_grad():
    """DeepSpeed's stage 0 (fp32, a torch optimizer) keeps no fp32 copy: None for the master and
    the optimizer state; the gradient is ``param.grad`` (None after the step zeroes it)."""
    engine, _ = _engine(0)
    _backward(engine)
    for _, p in _trainable(engine):
        assert utils.safe_get_full_fp32_param(p) is None
        assert utils.safe_get_full_grad(p) is p.grad is not None
    engine.step()
    for _, p in _trainable(engine):
        assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
        assert utils.safe_get_full_grad(p) is None
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_outside_backward_to_step_are_refused(stage):
    """DeepSpeed's message: its stages 1/2 keep the reduced gradients from the boundary's backward
    until ``step()`` only (its stage 3 returns the last step's; zerotrain's step zeroed them)."""
    engine, _ = _engine(stage)
    p = engine.module.a.weight
    with pytest.raises(ValueError, match="only available immediately after backward and before engine step"):
        utils.safe_get_full_grad(p)
    _backward(engine)
    assert utils.safe_get_full_grad(p) is not None
    engine.step()
    with pytest.raises(ValueError, match="only available immediately after backward and before engine step"):
        utils.safe_get_full_grad(p)
    with pytest.raises(ValueError, match="only available immediately after backward"):
        utils.safe_set_full_grad(p, torch.zeros(6, 4))
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_unknown_state_key_and_state_before_the_first_step(stage):
    """DeepSpeed 0.19.8: ``ValueError('<key> not found in optimizer state fragment')``."""
    engine, _ = _engine(stage)
    p = engine.module.b.weight
    with pytest.raises(ValueError, match="exp_avg not found in optimizer state fragment"):
        utils.safe_get_full_optimizer_state(p, "exp_avg")  # Adam has no state before its first step
    _backward(engine)
    engine.step()
    with pytest.raises(ValueError, match="momentum_buffer not found in optimizer state fragment"):
        utils.safe_get_full_optimizer_state(p, "momentum_buffer")
    with pytest.raises(ValueError, match="nope not found in optimizer state fragment"):
        utils.safe_set_full_optimizer_state(p, torch.zeros(2, 6), "nope")
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_frozen_parameters_and_tensors_no_engine_trains_answer_none(stage):
    engine, _ = _engine(stage)
    stray = nn.Parameter(torch.ones(3))
    _backward(engine)
    for p in (engine.module.frozen.weight, stray):
        assert utils.safe_get_full_fp32_param(p) is None
        assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
        assert utils.safe_get_full_grad(p) is None
        utils.safe_set_full_fp32_param(p, torch.zeros_like(p))  # a no-op, as DeepSpeed's
        utils.safe_set_full_grad(p, torch.zeros_like(p))
    assert torch.equal(stray, torch.ones(3))
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 2])
def test_local_api_is_zero3_only(stage):
    engine, _ = _engine(stage)
    for fn in (utils.safe_get_local_fp32_param, utils.safe_get_local_grad):
        with pytest.raises(AssertionError, match="only defined for ZeRO-3 partitioned parameters"):
            fn(engine.module.a.weight)
    with pytest.raises(AssertionError, match="only defined for ZeRO-3"):
        utils.safe_get_local_fp32_param(nn.Parameter(torch.ones(2)))
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_set_gradient_is_what_the_step_reads(stage):
    """``safe_set_full_grad`` and ``safe_update_full_grad_vectorized`` between backward and step:
    SGD (lr 1, no momentum) then moves each master by exactly the gradient set (one fp32 subtraction)."""
    engine, _ = _engine(stage, {"type": "SGD", "params": {"lr": 1.0}})
    _backward(engine)
    a, b = engine.module.a, engine.module.b
    before = {n: utils.safe_get_full_fp32_param(p) for n, p in _trainable(engine)}
    utils.safe_set_full_grad(a.weight, torch.full((6, 4), 0.25))
    old_bias = utils.safe_get_full_grad(b.bias)
    utils.safe_update_full_grad_vectorized([b.bias], lambda old, p: old * 2)
    assert torch.equal(utils.safe_get_full_grad(a.weight), torch.full((6, 4), 0.25))
    assert torch.equal(utils.safe_get_full_grad(b.bias), old_bias * 2)
    engine.step()
    # no clipping in this config; SGD's update is one subtraction: exact
    assert torch.equal(utils.safe_get_full_fp32_param(a.weight), before["a.weight"] - 0.25)
    assert torch.equal(utils.safe_get_full_fp32_param(b.bias), before["b.bias"] - old_bias * 2)
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_set_master_and_state_reach_the_next_step(stage):
    engine, _ = _engine(stage)
    _backward(engine)
    engine.step()
    w = engine.module.a.weight
    value = torch.arange(24, dtype=torch.float32).view(6, 4) / 8
    utils.safe_set_full_fp32_param(w, value)
    utils.safe_set_full_optimizer_state(w, torch.full((6, 4), 0.5), "exp_avg")
    assert torch.equal(utils.safe_get_full_fp32_param(w), value)
    assert torch.equal(utils.safe_get_full_optimizer_state(w, "exp_avg"), torch.full((6, 4), 0.5))
    with pytest.raises(ValueError, match="elements"):
        utils.safe_set_full_fp32_param(w, torch.zeros(5))
    # a step with a zero gradient and a zero first moment leaves Adam's master where it was set
    # (its update is lr * 0 / (sqrt(v) + eps) = 0, exactly); the working parameter follows it
    utils.safe_set_full_optimizer_state(w, torch.zeros(6, 4), "exp_avg")
    _backward(engine)
    utils.safe_set_full_grad(w, torch.zeros(6, 4))
    engine.step()
    with deepspeed.zero.GatheredParameters([w]):
        assert torch.equal(w.detach(), value)
    engine.destroy()


def test_local_api_at_stage3_round_trips():
    engine, _ = _engine(3)
    _backward(engine)
    w = engine.module.a.weight
    local = utils.safe_get_local_fp32_param(w)  # one rank: its fragment is the whole parameter
    assert torch.equal(local, utils.safe_get_full_fp32_param(w).view(-1))
    assert torch.equal(utils.safe_get_local_grad(w), utils.safe_get_full_grad(w).view(-1))
    utils.safe_set_local_grad(w, torch.full_like(local, 0.5))
    assert torch.equal(utils.safe_get_full_grad(w), torch.full((6, 4), 0.5))
    engine.step()
    utils.safe_set_local_fp32_param(w, torch.zeros_like(local))
    utils.safe_set_local_optimizer_state(w, torch.ones_like(local), "exp_avg")
    assert torch.equal(utils.safe_get_full_fp32_param(w), torch.zeros(6, 4))
    assert torch.equal(utils.safe_get_local_optimizer_state(w, "exp_avg"), torch.ones(24))
    with pytest.raises(AssertionError, match="Number of elements do not match"):
        utils.safe_set_local_fp32_param(w, torch.zeros(3))
    assert utils.safe_get_local_fp32_param(engine.module.frozen.weight) is None
    engine.destroy()


def test_zero1_gradient_before_the_boundary_and_inside_no_sync_is_the_local_accumulation():
    """DeepSpeed's ZeRO-1 reduces at the boundary only; before it (and inside ``no_sync``, which
    DeepSpeed's ``test_no_sync_ctxt.test_multiple_ctxts`` reads this way) ``safe_get_full_grad``
    answers the parameter's ``.grad``: this rank's accumulation, not a reduced partition."""
    torch.manual_seed(0)
    model = _Net()
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 1}}
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=config)[0]
    w = engine.module.a.weight
    _backward(engine)  # the first micro-batch: no reduction yet
    assert w.grad is not None and utils.safe_get_full_grad(w) is w.grad
    engine.step()
    _backward(engine)  # the boundary: the reduced partitions
    got = utils.safe_get_full_grad(w)
    assert got is not w.grad and got.shape == w.shape
    engine.step()
    engine.set_gradient_accumulation_boundary(True)
    with engine.no_sync():
        _backward(engine)
        assert w.grad is not None and utils.safe_get_full_grad(w) is w.grad
    engine.destroy()
