"""The split backward of zero-bubble schedules (strategies/pipeline/weight_grad.py): the
gradients of inputs first, linear weights' gradients later, equal to one autograd backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.strategies.pipeline.weight_grad import DeferWeightGrads, apply_weight_grads
from tolerance import assert_within_sum_bound


def _model() -> nn.Module:
    torch.manual_seed(0)
    emb = nn.Embedding(13, 8)
    head = nn.Linear(8, 13, bias=False)
    head.weight = emb.weight  # tied: the embedding's gradient comes from two places
    return nn.Sequential(emb, nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8, bias=False), head)


def _grads(model: nn.Module, tokens: torch.Tensor, micro: int, defer: bool, autocast: bool = False):
    """Gradients of the mean loss over ``micro`` micro-batches, accumulated; with ``defer`` every
    micro-batch's weight gradients run after all the backwards (the latest a schedule may)."""
    model.zero_grad(set_to_none=True)
    stashes = []
    for part in tokens.chunk(micro):
        stash: list = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if defer:
                with DeferWeightGrads(stash):
                    out = model(part)
            else:
                out = model(part)
            loss = out.float().logsumexp(-1).mean() / micro
        loss.backward()
        stashes.append(stash)
    if defer:
        assert all(stashes), "every micro-batch stashed weight gradients"
        for stash in stashes:
            apply_weight_grads(stash)
            assert stash == []
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _terms_abs_sum(tokens: torch.Tensor, micro: int, autocast: bool = False):
    """({name: sum|terms|} per element, {name: number of terms}) of each gradient of ``_grads``: a
    weight's gradient sums one outer product per token of every micro-batch (the tied weight's from
    two places: the embedding's rows and the head), a bias's one row per token; either order of the
    sum (autograd's, or the deferred one) is within sum_rtol(n) x sum|terms| of the exact sum."""
    model = _model()
    scale: dict = {}
    for part in tokens.chunk(micro):
        seen: list = []

        def keep(module, inputs, out):
            out.register_hook(lambda g: seen.append((module, inputs[0], g)))

        hooks = [m.register_forward_hook(keep) for m in model if isinstance(m, (nn.Linear, nn.Embedding))]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            (model(part).float().logsumexp(-1).mean() / micro).backward()
        for h in hooks:
            h.remove()
        for module, x, g in seen:
            g = g.detach().double().abs().flatten(0, -2)
            if isinstance(module, nn.Embedding):
                term = torch.zeros_like(module.weight, dtype=torch.float64).index_add_(0, x.flatten(), g)
            else:
                term = g.T @ x.detach().double().abs().flatten(0, -2)
                if module.bias is not None:
                    scale[module.bias] = scale.get(module.bias, 0) + g.sum(0)
            scale[module.weight] = scale.get(module.weight, 0) + term
    names = {p: name for name, p in model.named_parameters()}
    count = {name: tokens.numel() * (2 if name == "0.weight" else 1) for name in names.values()}
    return {names[p]: v for p, v in scale.items()}, count


@pytest.mark.parametrize("micro", [1, 4])
def test_deferred_weight_gradients_equal_autograd(micro):
    model = _model()
    tokens = torch.randint(0, 13, (8, 5), generator=torch.Generator().manual_seed(1))
    ref = _grads(model, tokens, micro, defer=False)
    got = _grads(model, tokens, micro, defer=True)
    assert ref.keys() == got.keys()
    scale, n = _terms_abs_sum(tokens, micro)
    for name in ref:
        # tolerance: two orders of one sum of n per-token terms (_terms_abs_sum): 2 sum_rtol(n) x sum|terms|
        assert_within_sum_bound(got[name], ref[name], n[name], scale.get(name, ref[name].abs()), what=name)


def test_deferred_weight_gradients_under_autocast_equal_autograd():
    model = _model()
    tokens = torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(2))
    ref = _grads(model, tokens, 2, defer=False, autocast=True)
    got = _grads(model, tokens, 2, defer=True, autocast=True)
    scale, n = _terms_abs_sum(tokens, 2, autocast=True)
    for name in ref:
        assert got[name].dtype == torch.float32
        # tolerance: the same bf16 products summed in fp32 in another order: 2 sum_rtol(n) x sum|terms| as above
        assert_within_sum_bound(got[name], ref[name], n[name], scale.get(name, ref[name].abs()), what=name)


def test_backward_leaves_linear_weights_for_later_and_the_rest_done():
    model = _model()
    stash: list = []
    with DeferWeightGrads(stash):
        out = model(torch.randint(0, 13, (2, 5)))
    out.sum().backward()
    linears = {id(m.weight) for m in model if isinstance(m, nn.Linear)}
    assert {id(w) for w, _, _ in stash} == linears  # the tied head included
    assert model[1].weight.grad is None and model[4].weight.grad is None
    assert model[1].bias.grad is not None and model[3].weight.grad is not None  # bias, norm: at once
    assert model[0].weight.grad is not None  # the embedding's own part; the head's part waits
    before = model[0].weight.grad.clone()
    apply_weight_grads(stash)
    assert model[1].weight.grad is not None and not torch.equal(model[0].weight.grad, before)


def test_no_grad_and_non_leaf_weights_run_plain_linear():
    lin = nn.Linear(4, 3)
    stash: list = []
    with DeferWeightGrads(stash):
        with torch.no_grad():
            lin(torch.randn(2, 4))
        w = lin.weight * 2  # not a leaf: its gradient flows back through autograd as usual
        torch.nn.functional.linear(torch.randn(2, 4), w).sum().backward()
    assert stash == [] and lin.weight.grad is not None
