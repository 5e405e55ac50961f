"""A checkpoint adapter that would save expert-parallel parameters under their local names (every
expert-parallel rank holds other experts under the same name) refuses, on every rank alike and
before any collective, rather than writing rank 0's experts as the whole model's."""
from types import SimpleNamespace

import pytest
import torch

from zerotrain.strategies.checkpoint import ReplicatedCheckpoint
from zerotrain.strategies.moe.experts import mark_expert

pytestmark = pytest.mark.timeout(60)


def _owner(ep_group: str) -> SimpleNamespace:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for p in module[1].parameters():
        mark_expert(p, ep_group)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return SimpleNamespace(module=module, optimizer=optimizer, name="ddp", is_global_zero=True, replica_rank=0)


@pytest.mark.parametrize("what", ["param_shards", "full_state_dict"])
def test_replicated_family_refuses_expert_parallel_parameters(what):
    adapter = ReplicatedCheckpoint(_owner("ep_size_2"))
    with pytest.raises(NotImplementedError, match=r"ddp: .*expert-parallel parameter '1.weight' \(ep_size_2\).*valid: zero1"):
        getattr(adapter, what)()


def test_refused_loads_too():
    adapter = ReplicatedCheckpoint(_owner("ep_size_2"))
    with pytest.raises(NotImplementedError, match="a checkpoint load of expert-parallel parameter"):
        adapter.load_param_shards(reader=None)


def test_experts_of_ep_size_1_are_dense_and_saved():
    shards = ReplicatedCheckpoint(_owner("ep_size_1")).param_shards()
    assert sorted(shards) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_zero_refuses_frozen_expert_parameters_before_any_collective():
    """ZeRO would broadcast a frozen expert from rank 0 over every expert-parallel place (extras are
    replicated): refused at set-up with one line naming the parameter."""
    from zerotrain.strategies.zero.experts import refuse_frozen_experts

    module = _owner("ep_size_2").module
    refuse_frozen_experts(module, "zero2")  # trainable experts: accepted
    module[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"zero2: frozen expert-parallel parameter '1.weight' \(ep_size_2\)"):
        refuse_frozen_experts(module, "zero2")
    module[1].weight.allreduce = True  # no longer an expert: a frozen dense parameter is fine
    refuse_frozen_experts(module, "zero2")
