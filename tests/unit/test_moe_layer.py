"""zerotrain's MoE layer (strategies/moe/) against DeepSpeed 0.19.8's ``deepspeed.moe.layer.MoE`` on
one process: built from the same seed they hold the same weights (the same construction order);
with the same seed before each forward (the same jitter, Gumbel and random-token-selection draws)
output, l_aux, exp_counts and every gradient agree, for top-1 and top-2, with and without dropping,
each noise policy, residual, train and eval. Tolerance: both compute the same sums, so a few fp32
eps times the longest reduction (the hidden size) times the values' scale."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from zerotrain.deepspeed.moe.layer import MoE as DeepSpeedMoE
from zerotrain.strategies.moe import GateConfig, MoE
from zerotrain.strategies.moe.gate import capacity_of

pytestmark = pytest.mark.timeout(180)

HIDDEN, EXPERTS, TOKENS = 8, 4, (3, 8)  # 24 tokens


@pytest.fixture(scope="module")
def ds_moe():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (zerotrain's `dev` extra); these cases compare against it")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.moe.layer import MoE as DSMoE

    return DSMoE


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 16), torch.nn.GELU(), torch.nn.Linear(16, HIDDEN))


def _pair(ds_moe, **kw):
    torch.manual_seed(3)
    theirs = ds_moe(HIDDEN, _expert(), num_experts=EXPERTS, **kw)
    torch.manual_seed(3)
    ours = DeepSpeedMoE(HIDDEN, _expert(), num_experts=EXPERTS, **kw)
    same_init = all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), ours.state_dict().values()))
    g = torch.Generator().manual_seed(5)  # distinct experts: DeepSpeed's copies start equal
    state = {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(state)
    ours.load_state_dict(state)
    return theirs, ours, same_init


def _run(layer, x, w, seed, train=True):
    layer.train(train)
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x)
    ((out * w).sum() + l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), l_aux.detach(), counts, x.grad, grads


CASES = {
    "top1": dict(k=1, use_rts=False),
    "top1_rts_drop": dict(k=1, capacity_factor=0.5, min_capacity=1),
    "top1_nodrop": dict(k=1, drop_tokens=False, use_rts=False),
    "top1_jitter": dict(k=1, noisy_gate_policy="Jitter", capacity_factor=0.75, min_capacity=1),
    "top1_rsample": dict(k=1, noisy_gate_policy="RSample", capacity_factor=0.75, min_capacity=1),
    "top1_residual": dict(k=1, use_residual=True, capacity_factor=0.5, min_capacity=1),
    "top2": dict(k=2, top2_2nd_expert_sampling=False),
    "top2_drop_sampled": dict(k=2, capacity_factor=0.4, min_capacity=1),
    "top2_nodrop": dict(k=2, drop_tokens=False),
    "top2_residual": dict(k=2, use_residual=True, capacity_factor=0.5, min_capacity=1),
}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_deepspeed(ds_moe, case, train):
    kw = dict(CASES[case], eval_capacity_factor=CASES[case].get("capacity_factor", 1.0) * 1.5)
    theirs, ours, same_init = _pair(ds_moe, **kw)
    assert same_init
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(*TOKENS, HIDDEN, generator=g), torch.randn(*TOKENS, HIDDEN, generator=g)
    want, got = _run(theirs, x, w, 7, train), _run(ours, x, w, 7, train)
    tol = 8 * torch.finfo(torch.float32).eps * HIDDEN * 16
    torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[3], want[3], atol=tol, rtol=tol)
    assert got[4].keys() == want[4].keys()
    for name in want[4]:
        torch.testing.assert_close(got[4][name], want[4][name], atol=tol, rtol=tol, msg=name)


def test_dropping_cases_drop():
    """The dropping cases above do drop tokens (so the comparison covers which ones)."""
    n = TOKENS[0] * TOKENS[1]
    assert capacity_of(n, EXPERTS, 0.5, 1) * EXPERTS < n
    assert capacity_of(n, EXPERTS, 0.4 * 2, 1) * EXPERTS < 2 * n


def test_bad_arguments_say_what_is_valid():
    with pytest.raises(ValueError, match="ep_size=3; valid: a divisor of num_experts=4"):
        MoE(HIDDEN, _expert(), num_experts=4, ep_size=3)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gumbel'"):
        MoE(HIDDEN, _expert(), num_experts=4, gate=GateConfig(noisy_gate_policy="Gumbel"))
    with pytest.raises(ValueError, match="k=3; valid: 1, 2"):
        MoE(HIDDEN, _expert(), num_experts=4, gate=GateConfig(k=3))


def test_zerotrain_moe_is_the_layers_package():
    import zerotrain
    import zerotrain.moe

    assert zerotrain.moe is zerotrain.strategies.moe and zerotrain.moe.MoE is MoE
