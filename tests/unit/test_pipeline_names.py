"""One process: the pieces that let a model that is not a PipelineModule run as one and share the
per-parameter checkpoint layout of every strategy.

* ``PipelineModule`` names: ``plain_key`` (a layer's path in the plain model), ``canonical_key``
  (a tied parameter's first name), ``saves_key`` (only the lowest owning stage writes a tie, with
  virtual stages by the chunk cut);
  ``from_sequential`` keeps an OrderedDict Sequential's names;
* the demo GPT's ``pipeline_layers`` compute its forward exactly, so does its compute-balanced
  ``pipeline_cut`` (a block split into halves under the block's name), and ``GPTModule.to_pipeline``
  (the hook the strategy calls) gives a one-stage pipeline whose checkpoint names are the GPT's;
* an evaluation batch that ``micro_batches`` does not divide is split unevenly with row-weighted
  losses (the batch's mean), a training batch is refused naming its rows and ``micro_batches``;
  with virtual stages the parts come in whole groups of stages.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from tolerance import mean_rtol

from zerotrain.examples.gpt import GPT, BlockHalf, GPTConfig, lm_loss
from zerotrain.examples.gpt_module import GPTModule
from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy
from zerotrain.strategies.precision import Precision
from zerotrain.trainer.errors import ConfigError

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)


class _Hooks:
    accumulation = 1

    def loss_of(self, out):
        return out


def _strategy(module: nn.Module, micro_batches: int = 4) -> PipelineStrategy:
    strategy = PipelineStrategy(stages=1, micro_batches=micro_batches)
    strategy.connect(ProcessInfo(), torch.device("cpu"), Precision())
    strategy.setup_environment()
    strategy.configure_model(module)
    strategy.setup_module(module)
    strategy.setup_optimizer(torch.optim.AdamW(strategy.parameters_for_optimizer(), lr=1e-3))
    return strategy


def test_layer_names_map_keys_and_a_tie_is_saved_once_under_its_first_name():
    torch.manual_seed(0)
    gpt = GPT(TINY)
    pipe = PipelineModule.from_modules(gpt.pipeline_layers(), num_stages=3, loss_fn=lm_loss)
    last = pipe.num_layers - 1
    assert pipe.layer_names == ("wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head")
    assert pipe.plain_key("3.attn.c_attn.weight") == "blocks.1.attn.c_attn.weight"
    assert pipe.plain_key(f"{last}.weight") == "lm_head.weight"
    assert [t.members for t in pipe.ties] == [((0, "weight"), (last, "weight"))]  # the shared Parameter
    assert pipe.canonical_key(f"{last}.weight") == "wte.weight" == pipe.canonical_key("0.weight")
    assert pipe.canonical_key("1.weight") == "wpe.weight"
    pipe.build(pipe.num_stages - 1)  # the last stage holds the head's copy: another stage saves it
    assert not pipe.saves_key(f"{last}.weight") and pipe.saves_key(f"{last - 1}.weight")
    with pytest.raises(KeyError, match="does not name a layer"):
        pipe.plain_key("9.weight")


def test_with_virtual_stages_a_tie_is_saved_by_its_lowest_owning_stage_of_the_chunk_cut():
    """2 stages x 2 chunks of one layer each: chunk 1 of stage 1 (layer 1) and chunk 2 on stage 0
    (layer 2) share a weight; its first member lives on stage 1 but stage 0 owns it too, so
    stage 0 (where the broadcast starts) writes it, under the first member's name."""
    def cut(stage: int) -> PipelineModule:
        torch.manual_seed(0)
        layers = [nn.Linear(3, 3) for _ in range(4)]
        layers[2].weight = layers[1].weight
        pipe = PipelineModule.from_modules([(f"l{i}", m) for i, m in enumerate(layers)], 2,
                                           partition_method="uniform")
        pipe.set_virtual_stages(2)
        pipe.build(stage)
        return pipe

    first, second = cut(0), cut(1)
    assert [first.stage_of_layer(i) for i in range(4)] == [0, 1, 0, 1]
    assert first.canonical_key("2.weight") == "l1.weight" == second.canonical_key("1.weight")
    assert first.saves_key("2.weight") and first.saves_key("0.weight")
    assert not second.saves_key("1.weight") and second.saves_key("1.bias")


def test_from_sequential_keeps_the_sequential_names():
    seq = nn.Sequential(OrderedDict(embed=nn.Embedding(5, 4), body=nn.Linear(4, 4), head=nn.Linear(4, 5)))
    seq.head.weight = seq.embed.weight
    pipe = PipelineModule.from_sequential(seq, 2)
    assert pipe.layer_names == ("embed", "body", "head")
    assert pipe.canonical_key("2.weight") == "embed.weight" and pipe.plain_key("2.bias") == "head.bias"
    assert PipelineModule.from_sequential(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), 1).layer_names == ("0", "1")
    with pytest.raises(ValueError, match=r"layers 0 and 1 are both 'a' and both hold 'bias'; valid: distinct"):
        PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], 1, layer_names=["a", "a"])
    with pytest.raises(ValueError, match=r"layer_names=\['a'\]; valid: 2 non-empty"):
        PipelineModule([nn.Tanh(), nn.Tanh()], 1, layer_names=["a"])


def test_gpt_pipeline_layers_compute_its_forward_exactly():
    torch.manual_seed(0)
    gpt = GPT(TINY)
    idx, targets = torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))
    logits, loss = gpt(idx, targets)
    x = idx
    for _, layer in gpt.pipeline_layers():
        x = layer(x)
    assert torch.equal(x, logits) and torch.equal(lm_loss(x, targets), loss)
    with pytest.raises(ValueError, match="exceeds GPTConfig.block_size=16"):
        gpt.pipeline_layers()[1][1](torch.zeros(1, 17, 16))


def test_gpt_compute_cut_splits_the_block_its_bound_falls_in_and_keeps_the_gpt_names():
    """``GPT.pipeline_cut``: 3 blocks of d=64 (attention 20480 multiply-adds per token, MLP 32768)
    with the head and loss (16640) on the last stage: the balanced bound falls after block 1's
    attention, so block 1 is its two halves, both named ``blocks.1``; every other block is whole.
    The pieces compute the GPT's forward exactly, and each stage's keys are the plain GPT's."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=64, n_layer=3, n_head=2, n_embd=64))
    layers, bounds = gpt.pipeline_cut(2)
    names = [n for n, _ in layers]
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    assert bounds == [0, 4, 8]  # stage 1 starts at block 1's MLP half
    assert [sorted(dict(layers[i][1].named_children())) for i in (3, 4)] == [["attn", "ln_1"], ["ln_2", "mlp"]]
    idx, targets = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    x = idx
    for _, layer in layers:
        x = layer(x)
    assert torch.equal(x, gpt(idx, targets)[0])
    pipe = PipelineModule.from_modules(layers, 2, loss_fn=lm_loss, partition_method=bounds)
    assert pipe.bounds == bounds
    plain = set(gpt.state_dict())
    keys = [pipe.plain_key(f"{i}.{k}") for i, (_, layer) in enumerate(layers) for k in layer.state_dict()]
    assert sorted(keys) == sorted(plain)  # each of the plain GPT's keys once
    assert pipe.plain_key("3.ln_1.weight") == "blocks.1.ln_1.weight"
    assert pipe.plain_key("4.mlp.c_fc.weight") == "blocks.1.mlp.c_fc.weight"
    # an even cut between blocks leaves every block whole: 4 blocks with a light head
    layers, bounds = GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=64)).pipeline_cut(2)
    assert [n for n, _ in layers].count("blocks.1") == 1 and all(
        not isinstance(layer, BlockHalf) for _, layer in layers)
    with pytest.raises(ValueError, match=r"GPTConfig.pipeline_cut='even'; valid: 'parameters', 'compute'"):
        GPTConfig(pipeline_cut="even")


def test_gpt_module_cuts_itself_for_the_strategy_with_the_gpt_names():
    torch.manual_seed(0)
    module = GPTModule(config=TINY)
    module.configure_model()
    plain = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = _strategy(module)
    assert isinstance(module.model, PipelineModule) and strategy.pipe is module.model
    info = strategy.checkpoint_model_info()
    assert list(info["params"]) == [k for k in plain if k != "model.lm_head.weight"]
    assert info["aliases"] == {"model.lm_head.weight": "model.wte.weight"} and info["keys"] == list(plain)
    assert sorted(strategy.param_shards()) == sorted(info["params"])
    full = strategy.full_state_dict()
    assert list(full) == list(plain) and all(torch.equal(full[k], v) for k, v in plain.items())
    assert [sorted(g) for g in strategy.optimizer_group_names()] == [sorted(info["params"])]


def test_a_module_with_no_pipeline_and_no_hook_is_refused_naming_both():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)

        def configure_model(self):
            pass

    strategy = PipelineStrategy(stages=1)
    strategy.connect(ProcessInfo(), torch.device("cpu"), Precision())
    strategy.setup_environment()
    with pytest.raises(ValueError, match=r"needs a PipelineModule inside Plain .* or a to_pipeline\(num_stages\)"):
        strategy.configure_model(Plain())


def test_an_uneven_evaluation_batch_is_the_mean_and_an_uneven_training_batch_is_refused():
    torch.manual_seed(0)
    module = GPTModule(config=TINY)
    module.configure_model()
    gpt = GPT(TINY)
    gpt.load_state_dict({k.removeprefix("model."): v for k, v in module.state_dict().items()})
    strategy = _strategy(module, micro_batches=4)
    g = torch.Generator().manual_seed(1)
    for rows in (6, 5, 3, 1):  # parts of 2,2,1,1 / 2,1,1,1 / three of 1 / one of 1
        x, y = torch.randint(0, 256, (rows, 16), generator=g), torch.randint(0, 256, (rows, 16), generator=g)
        # tolerance: two orders and groupings of one mean of rows x 16 cross-entropies (>= 0, so mean|terms| is the
        # loss): the parts' means weighted by their shares, 3 roundings more: 2 mean_rtol(n, ops=3) relative
        want = gpt(x, y)[1].detach()
        torch.testing.assert_close(strategy.validation_step((x, y), 0), want, rtol=2 * mean_rtol(rows * 16, ops=3),
                                   atol=0)
    with pytest.raises(ConfigError, match=r"a training batch of 6 rows cannot be split into micro_batches=4 .*"
                                          r"divisible by 4"):
        strategy.run_schedule((x.repeat(6, 1)[:6], y.repeat(6, 1)[:6]), 0, _Hooks())


def test_an_interleaved_evaluation_batch_is_cut_into_whole_groups_of_stages():
    """Virtual stages: the interleaved order cycles through the micro-batches a group of stages
    at a time, so a short evaluation batch gets a multiple of the stages, all its rows kept, and
    one with fewer rows than stages is refused."""
    strategy = PipelineStrategy(stages=2, micro_batches=4, virtual_stages=2)
    strategy.connect(ProcessInfo(world_size=2, local_world_size=2), torch.device("cpu"), Precision())
    for rows, sizes in ((9, [3, 2, 2, 2]), (5, [2, 1, 1, 1]), (3, [2, 1]), (2, [1, 1])):
        x, y = torch.zeros(rows, 3), torch.zeros(rows, 1)
        inputs, targets = strategy.split_batch((x, y), train=False)
        assert [len(t) for t in inputs] == sizes == [len(t) for t in targets]
    with pytest.raises(ConfigError, match=r"an evaluation batch of 1 rows with virtual_stages=2 on stages=2"):
        strategy.split_batch((torch.zeros(1, 3), torch.zeros(1, 1)), train=False)
