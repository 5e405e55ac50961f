"""Tensor-parallel plans (strategies/parallel/tensor_plan.py, issue 45) without processes: the three
vocabularies resolve to the same styles, bad plans are refused before any module changes, and a
packed shard (a fused q/k/v cut by heads) joins back to the whole."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotrain.examples.gpt import GPT, GPTConfig
from zerotrain.strategies.parallel import TensorShard, parallelize_tensor
from zerotrain.strategies.parallel.tensor_plan import resolve_style

pytestmark = pytest.mark.timeout(60)


def test_vocabularies_resolve_alike():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linear, emb = nn.Linear(4, 4), nn.Embedding(8, 4)
    assert resolve_style("colwise", linear, "x") == resolve_style(ColwiseParallel(), linear, "x") == ("colwise", 1)
    assert resolve_style("colwise_gather_output", linear, "x") == ("colwise_rep", 1)
    assert resolve_style(ColwiseParallel(output_layouts=Replicate()), linear, "x") == ("colwise_rep", 1)
    assert resolve_style("rowwise", linear, "x") == resolve_style(RowwiseParallel(), linear, "x") == ("rowwise", 1)
    assert resolve_style(RowwiseParallel(input_layouts=Replicate()), linear, "x") == ("rowwise_rep", 1)
    assert resolve_style("embedding_rowwise", emb, "x") == ("embedding_rowwise", 1)
    assert resolve_style(RowwiseParallel(input_layouts=Replicate()), emb, "x") == ("embedding_rowwise", 1)
    assert resolve_style("packed_colwise", linear, "x") == ("colwise", 2)
    assert resolve_style(("packed_colwise", 3), linear, "x") == ("colwise", 3)
    with pytest.raises(NotImplementedError, match="RowwiseParallel with output Replicate, or Shard"):
        resolve_style(RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), linear, "x")
    with pytest.raises(NotImplementedError, match="use_local_output=False"):
        resolve_style(ColwiseParallel(use_local_output=False), linear, "x")


@pytest.mark.parametrize("plan, error", [
    ({"blocks.*.attn.c_attn": "diagonal"}, "'blocks.*.attn.c_attn': 'diagonal'; valid: colwise, colwise_rep"),
    ({"blocks.*.attention": "colwise"}, "'blocks.*.attention' matches no module of GPT"),
    ({"ln_f": "colwise"}, "'ln_f' is a LayerNorm; colwise applies to an nn.Linear"),
    ({"lm_head": "colwise"}, "lm_head.weight is tied to wte.weight, which the plan leaves whole"),
])
def test_bad_plans_are_refused_before_any_change(plan, error):
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=error.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        parallelize_tensor(model, group=None, plan=plan)
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_no_plan_at_all_is_refused():
    with pytest.raises(ValueError, match="no plan given and Sequential has none"):
        parallelize_tensor(nn.Sequential(nn.Linear(2, 2)), group=None)


def test_packed_shards_take_every_block_by_heads_and_join_back():
    whole = torch.arange(3 * 8 * 2.0).reshape(3 * 8, 2)  # q, k, v of 8 rows each (4 heads of 2)
    parts = [TensorShard(dim=0, size=4, rank=r, chunks=3).cut(whole) for r in range(4)]
    assert torch.equal(parts[1], torch.cat([whole[2:4], whole[10:12], whole[18:20]]))  # head 1 of q, k, v
    assert torch.equal(TensorShard(0, 4, 0, 3).join(parts), whole)
    with pytest.raises(ValueError, match="does not divide into 3 block"):
        TensorShard(dim=0, size=4, rank=0, chunks=3).cut(torch.zeros(18, 2))


def test_a_module_without_a_plan_takes_its_submodules_plans_under_their_paths():
    from zerotrain.strategies.parallel import plan_of

    holder = nn.Module()
    holder.gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    holder.head = nn.Linear(2, 2)
    plan = plan_of(holder)
    assert plan == {f"gpt.{k}": v for k, v in GPT.tp_plan.items()} and plan_of(holder.gpt) == GPT.tp_plan


def test_a_tensor_axis_over_a_module_without_a_plan_leaves_it_whole_with_a_warning():
    from zerotrain.strategies.parallel.tensor_plan import cut_for_mesh

    class Strategy:  # the two questions cut_for_mesh asks of a strategy
        module = nn.Sequential(nn.Linear(2, 2))

        def mesh_size(self, axis):
            return 2

        def mesh_group(self, axis):
            raise AssertionError("no group is needed when nothing is cut")

    s = Strategy()
    with pytest.warns(UserWarning, match="Sequential declares no tp_plan .* every tensor rank holds the whole model"):
        cut_for_mesh(s)
    assert type(s.module[0]) is nn.Linear
