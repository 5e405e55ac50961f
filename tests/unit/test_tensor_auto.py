"""The tensor-parallel plan found by name and shape (strategies/parallel/tensor_auto.py, issue 45),
without processes: GPT-2's Conv1D projections (fused ``c_attn`` as 3 blocks), the same rule giving
Llama's own ``tp_plan`` back, and what it leaves whole."""
from __future__ import annotations

import importlib.util

import pytest
from torch import nn

from zerotrain.strategies.parallel.tensor_auto import plan_by_shape
from zerotrain.strategies.parallel.tensor_conv1d import is_conv1d, linear_features
from zerotrain.strategies.parallel.tensor_plan import _pattern, resolve_style

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")]


def _gpt2(n_head: int = 4):
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=n_head, vocab_size=128,
                                                                n_positions=32, bos_token_id=0, eos_token_id=0))


def test_gpt2_conv1d_projections_are_found_by_name_and_shape():
    model = _gpt2()
    plan, attrs, whole = plan_by_shape(model, 2)
    for i in range(2):
        assert plan[f"transformer.h.{i}.attn.c_attn"] == ("colwise", 3)  # [q | k | v], each by heads
        assert plan[f"transformer.h.{i}.attn.c_proj"] == "rowwise"
        assert plan[f"transformer.h.{i}.mlp.c_fc"] == "colwise"
        assert plan[f"transformer.h.{i}.mlp.c_proj"] == "rowwise"
        assert attrs[f"transformer.h.{i}.attn"] == {"split_size": 32, "num_heads": 2, "embed_dim": 32}
    assert len(plan) == 8 and whole == {}
    conv = model.transformer.h[0].attn.c_attn
    assert is_conv1d(conv) and linear_features(conv) == (64, 192)
    assert resolve_style(("colwise", 3), conv, "c_attn") == ("colwise", 3)
    with pytest.raises(ValueError, match="is a Hugging Face Conv1D; colwise_sp applies to an nn.Linear"):
        resolve_style("colwise_sp", conv, "c_attn")


def test_heads_that_do_not_divide_leave_the_attention_whole():
    plan, attrs, whole = plan_by_shape(_gpt2(n_head=2), 4)  # 2 heads over 4 ranks
    assert "transformer.h.0.attn.c_attn" not in plan and plan["transformer.h.0.mlp.c_fc"] == "colwise"
    assert "2 attention heads do not divide into 4 ranks" in whole["transformer.h.0.attn"]
    assert attrs == {}


def test_the_rule_gives_llamas_own_plan_back():
    """The rule is not GPT-2's: on Llama (which declares a tp_plan) it finds the same layer entries
    (the embedding and head aside, which the rule leaves whole)."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    plan, attrs, whole = plan_by_shape(model, 2)
    names = [n for n, _ in model.named_modules() if n]
    own = {}
    for key, style in model.tp_plan.items():
        if "layers" in key:
            own.update({n: style for n in names if _pattern(key).fullmatch(n)})
    assert plan == own and len(plan) == 14 and whole == {}


def test_a_fused_query_key_value_stays_whole_and_nothing_found_is_empty():
    import transformers

    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4))
    plan, _, whole = plan_by_shape(model, 2)
    assert plan == {"gpt_neox.layers.0.mlp.dense_h_to_4h": "colwise", "gpt_neox.layers.0.mlp.dense_4h_to_h": "rowwise"}
    assert "query_key_value: a fused projection whose layout" in whole["gpt_neox.layers.0.attention"]

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"hidden_size": 4})()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    assert plan_by_shape(Bare(), 2)[0] == {}
    with pytest.raises(ValueError, match="has no config.hidden_size"):
        plan_by_shape(nn.Sequential(nn.Linear(2, 2)), 2)
