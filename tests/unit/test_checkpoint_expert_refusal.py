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
    return SimpleNamespace(module=module, optimizer=optimizer, name="ddp", is_global_zero=True)


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
