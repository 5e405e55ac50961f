"""``sequence_parallel=n`` on the strategies (issue 45): refused before any rank starts where it
cannot run (bad value, a world it does not divide, a strategy without that axis); the batch cut
along the sequence (``shard_sequence``), and the mesh's answers on one process without a mesh.
The training itself: tests/distributed/test_sequence_parallel_trainer.py."""
import pytest
import torch

from zerotrain.strategies import DDP, SingleDevice, ZeroStage1, ZeroStage3, strategy_from_name
from zerotrain.strategies.parallel import sequence_mean, shard_sequence


def test_option_checked_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"DDPStrategy: sequence_parallel=0; valid: a whole number >= 1"):
        DDP(sequence_parallel=0)
    with pytest.raises(ValueError, match=r"sequence_parallel=2 does not divide the 3 processes .*multiple of 2"):
        ZeroStage1(sequence_parallel=2).check_world_size(3)
    with pytest.raises(ValueError, match=r"sequence_parallel=2 does not divide the 1 processes"):
        SingleDevice(sequence_parallel=2).check_world_size(1)
    ZeroStage3(sequence_parallel=2).check_world_size(4)
    assert strategy_from_name("zero2", sequence_parallel=2).parallel_sizes == {"sequence": 2, "tensor": 1}


def test_an_axis_the_strategy_does_not_run_over_is_refused():
    s = SingleDevice()
    s.parallel_sizes = {"sequence": 1, "tensor": 2}  # the base's axes: sequence only
    with pytest.raises(ValueError, match=r"tensor_parallel=2; this strategy runs over sequence; valid: tensor_parallel=1"):
        s.check_world_size(2)


def test_without_a_mesh_every_rank_is_a_data_replica():
    s = DDP()
    s.build_mesh()
    assert s.mesh is None and s.data_parallel_world_size == s.replica_world_size == s.mesh_size("data") == 1
    assert s.mesh_size("sequence") == 1 and s.mesh_rank("sequence") == 0 and s.mesh_group("sequence") is None
    batch = (torch.zeros(2, 8), torch.ones(2, 8))
    assert s.local_batch(batch) is batch
    assert torch.equal(s.sequence_positions(4), torch.arange(4))
    assert s.sequence_loss(torch.tensor(6.0), 4).item() == 1.5


def test_shard_sequence_cuts_every_batch_tensor_along_dim_1():
    ids = torch.arange(24).reshape(2, 12)
    x, y, w = shard_sequence((ids, ids + 100, torch.ones(2)), 2, 3)
    assert torch.equal(x, ids[:, 8:]) and torch.equal(y, ids[:, 8:] + 100)
    assert torch.equal(w, torch.ones(2))  # one dimension: no sequence, kept whole
    out = shard_sequence({"input_ids": ids, "labels": ids, "note": "x"}, 1, 2)
    assert torch.equal(out["input_ids"], ids[:, 6:]) and out["note"] == "x"
    assert torch.equal(out["position_ids"], torch.arange(6, 12).expand(2, -1))  # the whole sequence's, cut alike
    with pytest.raises(ValueError, match=r"sequence length 12 \(dimension 1\), which does not divide over "
                                         r"sequence_parallel=5; valid: a multiple of 5"):
        shard_sequence(ids, 0, 5)


def test_sequence_mean_on_one_rank_is_the_token_mean():
    assert sequence_mean(torch.tensor(9.0), 3, None, 1).item() == 3.0
