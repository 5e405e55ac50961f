"""use_ulysses (strategies/parallel/hf.py) refuses what it cannot do right, before any exchange: a
padding attention_mask with zeros (the shard's mask cannot describe the other shards' keys). An
all-ones mask is no mask. Skips without transformers."""
import pytest
import torch


def test_padding_mask_refused_and_cache_off():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.strategies.parallel import use_ulysses

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, use_cache=True))
    name = use_ulysses(model, group=None, name="zerotrain_ulysses_unit")
    assert model.config._attn_implementation == name and model.config.use_cache is False
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="padding attention_mask with zeros"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))
