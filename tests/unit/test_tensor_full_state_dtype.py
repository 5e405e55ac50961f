"""The full state dict of tensor-parallel parameters gathers the module's working copies; where
those are 16-bit (ZeRO's working parameters under bf16-mixed) it would hand out rounded values as
the fp32 weights, so it is refused in one line instead."""
from types import SimpleNamespace

import pytest
import torch

from zerotrain.strategies.parallel.tensor_plan import gather_full_state

pytestmark = pytest.mark.timeout(60)


def _strategy(dtype: torch.dtype) -> SimpleNamespace:
    module = torch.nn.Linear(4, 4).to(dtype)
    module.weight.tensor_parallel = "colwise"
    return SimpleNamespace(module=module, mesh_group=lambda axis: object())


def test_16bit_tensor_parallel_working_copies_are_not_handed_out_as_the_weights():
    with pytest.raises(NotImplementedError, match=r"tensor-parallel parameter 'weight' held in torch.bfloat16.*valid: precision 32"):
        gather_full_state(_strategy(torch.bfloat16), {"weight": torch.zeros(4, 4)})


def test_without_a_tensor_axis_the_state_is_returned_as_it_is():
    state = {"weight": torch.zeros(4, 4)}
    strategy = _strategy(torch.bfloat16)
    strategy.mesh_group = lambda axis: None
    assert gather_full_state(strategy, state) is state
