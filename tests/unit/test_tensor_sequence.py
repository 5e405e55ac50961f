"""The sequence-parallel variant of tensor parallelism (strategies/parallel/tensor_sequence.py,
issue 45) without processes: a sequence chunk's dropout mask is the plain model's for those tokens,
bit for bit, and advances the generator as the plain dropout does; the tensor-parallel region's
random numbers differ per tensor rank and leave the default stream in lockstep; the sequence-parallel
styles resolve from our vocabulary and torch's; the demo GPT's switch selects its sequence-parallel
plan."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.strategies.parallel import plan_of
from zerotrain.strategies.parallel.tensor_plan import resolve_style
from zerotrain.strategies.parallel.tensor_sequence import TensorRNG, sequence_dropout_mask

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("p", [0.1, 0.37])
def test_a_sequence_chunk_draws_the_plain_dropout_mask_of_its_tokens(p):
    x = torch.randn(3, 8, 5)
    torch.manual_seed(11)
    whole = F.dropout(x, p, training=True)
    after = torch.rand(4)  # where the plain model's stream goes next
    for rank, chunk in enumerate(x.chunk(2, dim=1)):
        torch.manual_seed(11)
        got = chunk * sequence_dropout_mask(chunk, p, 2, rank)
        assert torch.equal(got, whole.chunk(2, dim=1)[rank])  # bit for bit
        assert torch.equal(torch.rand(4), after)


def test_the_tensor_region_draws_per_rank_and_keeps_the_default_stream_in_lockstep():
    draws, afters = [], []
    for rank in (0, 1):
        torch.manual_seed(3)
        with TensorRNG(rank=rank)("cpu"):
            draws.append(torch.rand(6))
        afters.append(torch.rand(6))
    assert not torch.equal(draws[0], draws[1])  # other heads, another mask
    assert torch.equal(afters[0], afters[1])  # the replicated / sequence-sharded draws stay equal
    torch.manual_seed(3)
    torch.randint(0, 2 ** 62, (1,))  # the region's one draw from the default generator
    assert torch.equal(torch.rand(6), afters[0])
    torch.manual_seed(3)
    with TensorRNG(rank=1)("cpu"):
        assert torch.equal(torch.rand(6), draws[1])  # reproducible from the default generator's state


def test_sequence_parallel_styles_resolve_from_both_vocabularies():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    linear, emb, norm, drop = nn.Linear(4, 4), nn.Embedding(8, 4), nn.LayerNorm(4), nn.Dropout(0.1)
    assert resolve_style("colwise_sp", linear, "x") == resolve_style(
        ColwiseParallel(input_layouts=Shard(1)), linear, "x") == ("colwise_sp", 1)
    assert resolve_style(("colwise_sp", 3), linear, "x") == ("colwise_sp", 3)
    assert resolve_style("rowwise_sp", linear, "x") == resolve_style(
        RowwiseParallel(output_layouts=Shard(1)), linear, "x") == ("rowwise_sp", 1)
    assert resolve_style("embedding_rowwise_sp", emb, "x") == resolve_style(
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), emb, "x") == ("embedding_rowwise_sp", 1)
    for module in (norm, drop):
        assert resolve_style("sequence_parallel", module, "x") == resolve_style(SequenceParallel(), module, "x") \
            == ("sequence_parallel", 1)
    assert resolve_style("sequence_shard", drop, "x") == ("sequence_shard", 1)
    with pytest.raises(ValueError, match="'x' is a Linear; sequence_parallel applies to an nn.Dropout or a norm"):
        resolve_style("sequence_parallel", linear, "x")
    with pytest.raises(ValueError, match="'x' is a Sequential; sequence_shard applies"):
        resolve_style("sequence_shard", nn.Sequential(norm), "x")
    with pytest.raises(NotImplementedError, match="SequenceParallel\\(sequence_dim=0\\) is not supported"):
        resolve_style(SequenceParallel(sequence_dim=0), norm, "x")


def test_the_demo_gpt_switch_selects_its_sequence_parallel_plan():
    small = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)
    assert plan_of(GPT(GPTConfig(**small))) == GPT.tp_plan
    assert plan_of(GPT(GPTConfig(**small, tp_sequence_parallel=True))) == GPT.tp_plan_sequence_parallel
    assert GPT.tp_plan_sequence_parallel["ln_f"] == "sequence_parallel"


def test_the_cli_key_and_what_it_refuses(tmp_path):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from zerotrain.train import build, normalize_overrides, validate
    from zerotrain.trainer.errors import ConfigError

    def _config(*overrides):
        with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="config", overrides=normalize_overrides(list(overrides))))

    key = ("model=gpt_tiny", "model.tp_sequence_parallel=true", f"trainer.default_root_dir={tmp_path}")
    trainer, module = build(_config("strategy=ddp", "strategy.tensor_parallel=2", "trainer.devices=2", *key))
    module.configure_model()
    assert plan_of(module) == {f"model.{k}": v for k, v in GPT.tp_plan_sequence_parallel.items()}
    with pytest.raises(ConfigError, match=r"^model.block_size=63: does not cut into strategy.tensor_parallel=2 sequence "
                                          r"shards \(model.tp_sequence_parallel\); valid: a multiple of 2$"):
        validate(_config("strategy=ddp", "strategy.tensor_parallel=2", "trainer.devices=2", *key, "model.block_size=63"))
    with pytest.raises(ConfigError, match=r"^model.tp_sequence_parallel=True: is not built for the pipeline"):
        validate(_config("strategy=pipeline", "strategy.tensor_parallel=2", "strategy.micro_batches=2",
                         "trainer.devices=4", *key))


def test_the_pipeline_refuses_a_sequence_parallel_plan():
    from zerotrain.strategies.parallel.tensor_plan import sequence_parallel_keys
    from zerotrain.strategies.pipeline.tensor import cut_stage

    assert sequence_parallel_keys(GPT.tp_plan) == []
    assert sequence_parallel_keys(GPT.tp_plan_sequence_parallel)[:2] == ["blocks.*.attn.c_attn", "blocks.*.attn.c_proj"]
    with pytest.raises(NotImplementedError, match=r"pipeline: tensor_parallel=2 with a sequence-parallel plan "
                                                  r"\('blocks.\*.attn.c_attn'\) is not built"):
        cut_stage(nn.Linear(2, 2), None, "", GPT.tp_plan_sequence_parallel, None, 2)
