"""Tensor-parallel parameters in the reshardable checkpoint format, without processes
(``strategies/parallel/tensor_checkpoint.py``): the model described with whole shapes, and a load
that cuts this rank's shard (a packed q/k/v cut and a row-wise cut: neither is one range of the
whole) out of the whole tensors a checkpoint holds, the optimizer state as the parameter.
The save (collective) runs on real processes: tests/distributed/test_tensor_parallel_checkpoint.py."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerotrain.strategies.checkpoint import ReplicatedCheckpoint
from zerotrain.strategies.parallel import TensorShard
from zerotrain.strategies.parallel.tensor import shard_parameter
from zerotrain.strategies.parallel.tensor_checkpoint import (TensorAxis, TensorParallelCheckpoint, TensorShardReader,
                                                             full_shape)

pytestmark = pytest.mark.timeout(60)

WHOLE = {"qkv.weight": (12, 4), "qkv.bias": (12,), "proj.weight": (4, 6), "proj.bias": (4,)}


class DictReader:
    """A checkpoint of whole tensors (``ShardReader``): every kind of every name, flat."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def kinds(self, name):
        return sorted(self.tensors[name])

    def read(self, name, kind, start, end, out=None):
        part = self.tensors[name][kind].reshape(-1)[start:end].float()
        return part.clone() if out is None else out.copy_(part)

    def scalars(self, name):
        return {"step": torch.tensor(3.0)}

    def extra(self, name):
        raise KeyError(name)

    def param_groups(self, current):
        return current


def _cut_model(rank: int) -> nn.Module:
    """A q/k/v projection cut by heads (3 packed blocks along dim 0) and a row-wise projection (dim 1),
    as ``parallelize_tensor`` leaves them: plain Parameters marked ``tensor_parallel``."""
    model = nn.Module()
    model.qkv, model.proj = nn.Linear(4, 12), nn.Linear(6, 4)
    packed, rows = TensorShard(0, 2, rank, chunks=3), TensorShard(1, 2, rank)
    model.qkv.weight = shard_parameter(model.qkv.weight, packed)
    model.qkv.bias = shard_parameter(model.qkv.bias, packed)
    model.proj.weight = shard_parameter(model.proj.weight, rows)  # the row-wise bias stays whole
    return model


def _owner(model: nn.Module, tensor: int = 2) -> SimpleNamespace:
    return SimpleNamespace(module=model, optimizer=torch.optim.Adam(model.parameters()), name="ddp",
                           is_global_zero=True, replica_rank=0, mesh_size=lambda axis: tensor,
                           mesh_group=lambda axis: object() if tensor > 1 else None)


def test_the_model_is_described_with_whole_shapes():
    owner = _owner(_cut_model(1))
    adapter = TensorAxis(ReplicatedCheckpoint)(owner)
    assert isinstance(adapter, TensorParallelCheckpoint)
    info = adapter.checkpoint_model_info()
    assert {n: s for n, (s, _) in info["params"].items()} == WHOLE
    assert full_shape(owner.module.qkv.weight) == (12, 4) and tuple(owner.module.qkv.weight.shape) == (6, 4)
    plain = TensorAxis(ReplicatedCheckpoint)(_owner(nn.Linear(2, 2), tensor=1))
    assert type(plain) is ReplicatedCheckpoint  # no tensor axis, nothing cut: the family's adapter as it is


@pytest.mark.parametrize("rank", [0, 1])
def test_a_load_cuts_each_rank_shard_from_the_whole_tensors(rank):
    gen = torch.Generator().manual_seed(0)
    saved = {n: {k: torch.randn(s, generator=gen) for k in ("param", "exp_avg", "exp_avg_sq")}
             for n, s in WHOLE.items()}
    model = _cut_model(rank)
    owner = _owner(model)
    TensorAxis(ReplicatedCheckpoint)(owner).load_param_shards(DictReader(saved))
    for name, p in model.named_parameters():
        shard = getattr(p, "tensor_parallel", None)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            want = saved[name][kind] if shard is None else shard.cut(saved[name][kind])
            got = p.detach() if kind == "param" else owner.optimizer.state[p][kind]
            assert torch.equal(got, want), (name, kind)
    # local coordinates: any range of the shard, into a given buffer too
    reader = TensorShardReader(DictReader(saved), {"proj.weight": model.proj.weight})
    out = torch.empty(5)
    reader.read("proj.weight", "param", 3, 8, out=out)
    assert torch.equal(out, model.proj.weight.detach().reshape(-1)[3:8])
    assert reader.kinds("proj.bias") == ["exp_avg", "exp_avg_sq", "param"]  # the rest as saved


def test_a_cut_module_without_a_tensor_axis_is_refused():
    owner = _owner(_cut_model(0), tensor=1)  # cut by hand, the strategy has no tensor axis
    with pytest.raises(NotImplementedError, match="tensor_parallel=1"):
        TensorAxis(ReplicatedCheckpoint)(owner).load_param_shards(DictReader({}))


class _RenamingCheckpoint(ReplicatedCheckpoint):
    """An adapter whose checkpoint names are not the module's (the pipeline's: the non-pipelined
    model's) and which leaves one parameter to another rank (the pipeline's tied copy)."""

    def checkpoint_names(self):
        return {i: "plain." + n for i, n in self.trainable_names().items()}

    def saves(self, name):
        return name != "proj.weight"


def test_the_shards_are_named_and_saved_as_the_inner_adapter_says():
    adapter = TensorAxis(_RenamingCheckpoint)(_owner(_cut_model(0)))
    assert list(adapter.sharded()) == ["plain.qkv.weight", "plain.qkv.bias", "plain.proj.weight"]  # described, loaded
    assert list(adapter.sharded(saving=True)) == ["plain.qkv.weight", "plain.qkv.bias"]  # written here
