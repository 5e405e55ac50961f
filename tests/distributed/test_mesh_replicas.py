"""The strategy mesh's replica group (issue 45's foundation for tensor parallelism): ZeRO 1/2/3
partition and reduce over ``replica_group`` (the ranks holding the same parameters), not the
world. On 4 ranks as data=2 x tensor=2, with nothing sharded along the tensor axis (each tensor
rank holds the whole toy model and gets its tensor group's batch, as the loaders shard by the
data axis), every replica group must train exactly as 2-rank data parallelism does: the plain loop
over 2 ranks' global batches; each ZeRO partition is 1/2 of the model, not 1/4. (DDP over the
replicas with a real tensor axis: tests/distributed/test_tensor_parallel.py. Once ZeRO cuts a model
by its tp_plan too, this toy needs one, and the test becomes dp x tp.)
"""
from __future__ import annotations

import pytest

from harness import run_ranks
from toy import ToyModule, assert_params_close, reference
from zerotrain import Trainer

pytestmark = pytest.mark.timeout(300)

STEPS, BS, DATA = 6, 8, 2
N = BS * DATA * 24


def _fit(strategy: str) -> dict:
    from zerotrain.strategies import strategy_from_name

    s = strategy_from_name(strategy)
    s.parallel_sizes = {"sequence": 1, "tensor": 2}  # the axis tensor parallelism will set
    module = ToyModule(bs=BS, n=N)
    trainer = Trainer(strategy=s, devices=4, max_steps=STEPS, gradient_clip_val=0.5, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, precision="32")
    trainer.fit(module)
    out = {"params": {k.removeprefix("net."): v for k, v in trainer.full_state_dict().items()},
           "replicas": (s.replica_world_size, s.replica_rank, s.data_parallel_world_size, s.data_parallel_rank)}
    layouts = [fg.layout for fg in getattr(s, "flat_groups", [])] + [u.layout for u in getattr(s, "units", [])]
    out["partitions"] = [(lay.world_size, lay.partition_numel, lay.padded_numel) for lay in layouts]
    return out


@pytest.mark.parametrize("strategy", [pytest.param("zero1", marks=pytest.mark.slow), pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_replica_groups_train_as_two_rank_data_parallelism(tmp_path, strategy):
    results = run_ranks("test_mesh_replicas:_fit", 4, tmp_path, timeout=280, strategy=strategy)
    # rank = data * 2 + tensor: the replicas of ranks 0 and 1 are {0, 2} and {1, 3}
    assert [r["replicas"] for r in results] == [(2, 0, 2, 0), (2, 0, 2, 0), (2, 1, 2, 1), (2, 1, 2, 1)]
    for r in results:
        assert all(w == 2 and p * 2 == padded for w, p, padded in r["partitions"]), r["partitions"]
    assert results[0]["partitions"]
    want, peer = (reference(STEPS, DATA, bs=BS, clip=0.5, n=N, as_ranks=k) for k in (0, DATA))
    # tolerance: no worse than torch DDP's order of the same sums on 2 ranks (tolerance.PEER_FACTOR)
    assert_params_close(results[0]["params"], want["params"], peer["params"])
