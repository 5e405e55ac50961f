"""use_ulysses (strategies/parallel/hf.py) refuses, before any exchange, the masks a sequence shard
cannot describe for the other shards: a 4-D custom mask and a KV cache's offset positions. No mask
builds none (SDPA's causal path); a 2-D padding mask is gathered over the group
(tests/distributed/test_ulysses_hf.py). The model's KV cache is switched off. Skips without
transformers."""
import pytest
import torch


def test_masks_a_shard_cannot_describe_are_refused_before_any_exchange_and_cache_off():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.strategies.parallel import use_ulysses
    from zerotrain.strategies.parallel.hf import _mask_for

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, use_cache=True))
    name = use_ulysses(model, group=None, name="zerotrain_ulysses_unit")
    assert model.config._attn_implementation == name and model.config.use_cache is False
    mask = _mask_for(None)  # group None: any collective would fail, so each refusal comes first
    assert mask(1, 4, 4, attention_mask=None) is None
    with pytest.raises(NotImplementedError, match="4-D or block attention_mask"):
        mask(1, 4, 4, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="KV cache"):
        mask(1, 4, 4, kv_offset=2, attention_mask=torch.ones(1, 4, dtype=torch.long))
