"""``zerotrain.deepspeed.moe``: the DeepSpeed face of the MoE layer and the optimizer-group helpers,
against DeepSpeed 0.19.8 where it is installed: the same state-dict keys and initial weights from
the same seed, the same forward, and the same parameter groups from
``split_params_into_different_moe_groups_for_optimizer`` (order, names, options, cuts)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed
from zerotrain.deepspeed.moe.layer import MoE
from zerotrain.deepspeed.moe.utils import (has_moe_layers, is_moe_param,
                                           split_params_into_different_moe_groups_for_optimizer as split)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ds():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (zerotrain's `dev` extra); these cases compare against it")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.moe.layer
    import deepspeed.moe.utils

    return deepspeed.moe


class _Net(nn.Module):
    def __init__(self, moe_cls, ep_size: int = 1) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.moe = moe_cls(6, nn.Linear(6, 6), num_experts=4, ep_size=ep_size, k=2, use_residual=True,
                           min_capacity=1)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        y, l_aux, _ = self.moe(self.inp(x))
        return self.out(y), l_aux


def _build(moe_cls):
    torch.manual_seed(0)
    return _Net(moe_cls)


def test_the_layer_has_deepspeeds_keys_weights_and_forward(ds):
    theirs, ours = _build(ds.layer.MoE), _build(MoE)
    assert list(theirs.state_dict()) == list(ours.state_dict())
    for (name, a), b in zip(theirs.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randn(10, 6)
    for net in (theirs, ours):
        torch.manual_seed(1)
        net.result = net(x)
    torch.testing.assert_close(ours.result, theirs.result, rtol=0, atol=0)
    assert [(n, is_moe_param(p), getattr(p, "group_name", None)) for n, p in ours.named_parameters()] == \
        [(n, ds.utils.is_moe_param(p), getattr(p, "group_name", None)) for n, p in theirs.named_parameters()]
    assert has_moe_layers(ours) == (True, 4) and has_moe_layers(nn.Linear(2, 2)) == (False, 0)


def _groups(net):
    names = {id(p): n for n, p in net.named_parameters()}
    dense = [p for n, p in net.named_parameters() if "inp" in n or "out" in n]
    rest = [p for n, p in net.named_parameters() if "moe" in n]
    return [{"params": dense, "name": "dense", "lr": 0.1}, {"params": rest, "name": "moe_part", "lr": 0.2}], names


def _shape(groups, names):
    return [({k: v for k, v in g.items() if k != "params"}, [names[id(p)] for p in g["params"]]) for g in groups]


@pytest.mark.parametrize("max_group_size", [178956971, 40, None])
def test_split_gives_deepspeeds_groups(ds, max_group_size):
    theirs, ours = _build(ds.layer.MoE), _build(MoE)
    want = _shape(ds.utils.split_params_into_different_moe_groups_for_optimizer(
        _groups(theirs)[0], max_group_size=max_group_size), _groups(theirs)[1])
    got = _shape(split(_groups(ours)[0], max_group_size=max_group_size), _groups(ours)[1])
    assert got == want
    assert any(opts.get("moe") for opts, _ in got)  # the expert parameters did move


def test_split_without_experts_passes_groups_through_and_names_a_missing_key():
    p = nn.Parameter(torch.zeros(2))
    assert split({"params": iter([p]), "lr": 1}) == [{"params": [p], "lr": 1}]
    net = _build(MoE)
    with pytest.raises(ValueError, match=r"param_groups\[0\] has expert parameters and no 'name'"):
        split([{"params": list(net.parameters())}])
    assert deepspeed.moe.layer.MoE is MoE


def test_the_d_plus_e_layout_is_refused():
    with pytest.raises(ValueError, match="use_data_before_expert_parallel_=True; valid: False"):
        _build(MoE).moe.set_deepspeed_parallelism(use_data_before_expert_parallel_=True)
