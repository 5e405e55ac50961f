"""The rule that finds a Hugging Face MoE model's experts (strategies/moe/hf.py): transformers 5's
Mixtral, Qwen2-MoE and OLMoE experts containers are found, their routers (2-D [E, H] weights) and
Qwen2-MoE's shared expert are not; bad input is refused before anything is placed."""
from __future__ import annotations

import pytest
import torch

from zerotrain.strategies.moe.hf import find_experts, is_experts_module, use_expert_parallel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(60)

SMALL = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=16, num_experts_per_tok=2)
MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=8,
                                                                 shared_expert_intermediate_size=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}


def _model(arch: str):
    config_cls, model_cls, extra = MODELS[arch]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SMALL, **extra))


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_the_experts_containers_are_found_and_nothing_else(arch):
    model = _model(arch)
    assert [n for n, _ in find_experts(model)] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert not is_experts_module(model.model.layers[0].mlp.gate)  # the router: [E, H]


def test_ep_size_1_marks_the_experts_and_keeps_the_forward():
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up_proj
    ids = torch.randint(0, 32, (1, 5))
    want = model(ids).logits
    assert use_expert_parallel(model, 1) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert experts.gate_up_proj is before and before.allreduce is False and before.group_name == "ep_size_1"
    assert "forward" not in vars(experts)
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"Linear has no experts module .*valid: a Hugging Face MoE model"):
        use_expert_parallel(torch.nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide model.layers.0.mlp.experts.num_experts=4; "
                                         r"valid: a divisor of it"):
        use_expert_parallel(_model("olmoe"), 3)
