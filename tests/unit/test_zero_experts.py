"""ZeRO-1/2's expert param groups (strategies/zero/experts.py), without processes: which kind a
param group is, the refusal of a group mixing kinds, and the gradient-norm entries of an expert
flat group (one per expert-parallel place, this rank's own planned over its EDP partition)."""
from __future__ import annotations

import pytest
import torch

from zerotrain.strategies.moe import GateConfig, MoE
from zerotrain.strategies.moe.groups import ExpertGroups
from zerotrain.strategies.zero.experts import Partitioning, expert_norm_entries, group_kind
from zerotrain.strategies.zero.layout import build_layout


def _moe(ep: int) -> MoE:
    expert = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    return MoE(4, expert, num_experts=4, ep_size=ep, gate=GateConfig(k=1))


def test_a_group_is_dense_or_one_expert_group():
    moe = _moe(2)
    names = {id(p): n for n, p in moe.named_parameters()}
    experts = list(moe.layer.experts.parameters())
    assert group_kind(0, [moe.layer.gate.wg.weight], names) is None
    assert group_kind(1, experts, names) == "ep_size_2"
    assert group_kind(2, [], names) is None
    with pytest.raises(ValueError, match=r"param group 3 mixes dense parameter 'moe.gate.wg.weight' and expert "
                                         r"parameters of \['ep_size_2'\].*split_params_into_different_moe_groups"):
        group_kind(3, list(moe.parameters()), names)


def test_experts_of_ep_size_1_are_dense():
    """Replicated over the world like dense parameters: one group may hold both."""
    moe = _moe(1)
    names = {id(p): n for n, p in moe.named_parameters()}
    assert group_kind(0, list(moe.parameters()), names) is None


def test_an_expert_parameter_has_one_norm_entry_per_expert_parallel_place():
    """World 4, ep 2: this rank (2) is place 0 of its expert-parallel group [2, 3] and index 1 of
    its EDP group [0, 2]. Its place's entries are planned on its partition (the second expert's
    first weight is cut by the EDP partition: assembled over the EDP group, written by rank 0 of
    it); place 1's entries are left to ranks 1 and 3 (whole, nothing here)."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (6, 12, 6, 8)]
    layout = build_layout([p.numel() for p in params], 2)
    edp = object()
    part = Partitioning(edp, 1, 2, ExpertGroups(2, None, (2, 3), edp, (0, 2)))
    entries = expert_norm_entries(1, params, layout, part)
    assert len(entries) == 2 * len(params)
    mine, others = entries[0::2], entries[1::2]
    assert all(e.whole and not e.mine and e.comm is None for e in others)
    assert [e.whole for e in mine] == [True, False, True, True]
    assert [bool(e.mine) for e in mine] == [False, True, True, True]
    cut = mine[1]
    assert cut.comm is edp and cut.lead is False and [(pc.param_start, pc.numel) for pc in cut.mine] == [(10, 2)]
