"""Pipeline x tensor parallelism (issue 45), on one process: the grid's arithmetic (each stage a
tensor group of consecutive ranks; p2p, data-parallel and tie groups joining matching tensor ranks),
the GPT's plan read in the pipeline's names, a stage's forward following its replaced layers, and
``tensor_parallel=n`` checked before any rank starts (the strategy and the CLI key
``strategy.tensor_parallel``). The training: tests/distributed/test_pipeline_tensor.py."""
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn

from zerotrain.strategies import registry, strategy_from_name
from zerotrain.strategies.pipeline import PipelineGrid, PipelineModule, PipelineStrategy
from zerotrain.strategies.pipeline.tensor import stage_plan


def test_each_stage_is_a_tensor_group_and_links_join_matching_tensor_ranks():
    g = PipelineGrid(world_size=8, stages=2, tensor=2)
    assert g.replicas == 2
    assert [(g.replica_of(r), g.stage_of(r), g.tensor_of(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [g.tensor_ranks(s, r) for r in range(2) for s in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # p2p: tensor rank t of a stage with tensor rank t of the next
    assert [g.next_rank(r) for r in range(8)] == [2, 3, None, None, 6, 7, None, None]
    assert [g.prev_rank(r) for r in range(8)] == [None, None, 0, 1, None, None, 4, 5]
    assert [g.ring_next_rank(r) for r in (2, 3, 7)] == [0, 1, 5] and g.ring_prev_rank(1) == 3
    # data-parallel and tie groups: one tensor index each
    assert g.data_parallel_ranks(1, 1) == [3, 7] and g.data_parallel_ranks(0) == [0, 4]
    assert g.tie_ranks([1, 0], 1, 1) == [5, 7] and g.stage_ranks(1, 1) == [5, 7]
    assert g.rank_of(1, 1, 1) == 7
    with pytest.raises(IndexError):
        g.rank_of(0, 0, 2)
    plain = PipelineGrid(world_size=4, stages=2)  # without a tensor axis: as before
    assert [plain.next_rank(r) for r in range(4)] == [1, None, 3, None] and plain.data_parallel_ranks(1) == [1, 3]
    with pytest.raises(ValueError, match=r"world_size=6 is not a multiple of stages=2 x tensor_parallel=2"):
        PipelineGrid(world_size=6, stages=2, tensor=2)


def test_tensor_parallel_checked_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"PipelineStrategy: tensor_parallel=0; valid: a whole number >= 1"):
        PipelineStrategy(tensor_parallel=0)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 does not divide the 3 processes"):
        PipelineStrategy(tensor_parallel=2).check_world_size(3)
    with pytest.raises(ValueError, match=r"world_size=6 is not a multiple of stages=2 x tensor_parallel=2"):
        PipelineStrategy(stages=2, tensor_parallel=2).check_world_size(6)
    s = strategy_from_name("pipeline", tensor_parallel=2)
    s.check_world_size(4)
    assert s.parallel_sizes["tensor"] == 2 and s._grid_of(4).stages == 2  # one stage per tensor group
    assert registry.get("pipeline").fields()["tensor_parallel"] == ("int", 1)
    assert "sequence_parallel" not in registry.get("pipeline").fields()


class _Holder(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt


def test_the_gpts_plan_is_read_in_the_pipelines_names():
    from zerotrain.examples.gpt import GPT, GPTConfig
    from zerotrain.strategies.parallel.tensor_plan import plan_of

    holder = _Holder(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8)))
    plan = plan_of(holder)  # before to_pipeline: the GPT's names
    holder.gpt = pipe = PipelineModule.from_modules(holder.gpt.pipeline_layers(), 2, partition_method=[0, 3, 6])
    pipe.build(1)  # blocks.1, ln_f, lm_head
    assert stage_plan(holder, pipe, "gpt.", plan) == {
        "gpt.3.attn.c_attn": ("packed_colwise", 3), "gpt.3.attn.c_proj": "rowwise", "gpt.3.mlp.c_fc": "colwise",
        "gpt.3.mlp.c_proj": "rowwise", "gpt.5": "colwise"}
    # a plan in the pipeline's own names is taken as well
    assert stage_plan(holder, pipe, "gpt.", {"gpt.*.mlp.c_fc": "colwise"}) == {"gpt.3.mlp.c_fc": "colwise"}


def test_a_stage_runs_the_layers_that_replaced_its_own():
    pipe = PipelineModule([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)], 1)
    pipe.build(0)
    old, new = pipe.get_submodule("2"), nn.Linear(2, 2)
    pipe.add_module("2", new)
    x = torch.randn(3, 2)
    assert torch.equal(pipe(x), old(torch.relu(pipe.get_submodule("0")(x))))  # still the old layer
    pipe.follow_replaced_layers({id(old): new})
    assert torch.equal(pipe(x), new(torch.relu(pipe.get_submodule("0")(x))))


def _config(*overrides):
    from zerotrain.train import normalize_overrides

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=normalize_overrides(list(overrides))))


def test_the_cli_key_builds_the_strategy_and_refuses_what_the_gpt_cannot_cut(tmp_path):
    from zerotrain.train import build, validate
    from zerotrain.trainer.errors import ConfigError

    root = f"trainer.default_root_dir={tmp_path}"
    pipeline = ("strategy=pipeline", "strategy.tensor_parallel=2", "strategy.micro_batches=2", "model=gpt_tiny",
                "trainer.devices=4", root)
    trainer, _ = build(_config(*pipeline))
    assert type(trainer.strategy).__name__ == "PipelineStrategy" and trainer.strategy.mesh_size("tensor") == 2
    validate(_config(*pipeline))  # checkpoints on: pp x tp saves and loads them (no refusal)
    trainer, _ = build(_config("strategy=ddp", "strategy.tensor_parallel=2", "model=gpt_tiny", root))
    assert trainer.strategy.parallel_sizes["tensor"] == 2
    with pytest.raises(ConfigError, match=r"^strategy.tensor_parallel=4: does not divide model.n_head=2 \(the GPT's "
                                          r"tensor-parallel plan cuts its heads and its vocabulary\); valid: 1, 2$"):
        validate(_config("strategy=zero1", "strategy.tensor_parallel=4", "model=gpt_tiny", "trainer.devices=4"))
