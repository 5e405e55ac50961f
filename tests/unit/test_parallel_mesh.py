"""ParallelMesh's arithmetic (strategies/parallel/mesh.py): rank -> coordinates -> sub-group members
on 4 and 8 ranks, the sequence axis inside the data axis and the tensor axis innermost; the replicas
(the ranks holding the same parameters: data x sequence); bad sizes refused with the field and valid values.
The groups themselves, built through init_device_mesh on 4 gloo ranks: tests/distributed/test_ulysses.py."""
import pytest

from zerotrain.strategies.parallel import AXES, ParallelMesh


def test_four_ranks_data_by_sequence():
    mesh = ParallelMesh(data=2, sequence=2)
    assert mesh.shape == (2, 2, 1) and mesh.world_size == 4 and AXES == ("data", "sequence", "tensor")
    assert [mesh.coordinates(r) for r in range(4)] == [
        {"data": 0, "sequence": 0, "tensor": 0}, {"data": 0, "sequence": 1, "tensor": 0},
        {"data": 1, "sequence": 0, "tensor": 0}, {"data": 1, "sequence": 1, "tensor": 0}]
    assert [mesh.rank_of(**mesh.coordinates(r)) for r in range(4)] == [0, 1, 2, 3]
    assert mesh.all_groups("sequence") == [[0, 1], [2, 3]]  # consecutive ranks share a sequence group
    assert mesh.all_groups("data") == [[0, 2], [1, 3]]
    assert mesh.members("sequence", 3) == [2, 3] and mesh.members("data", 3) == [1, 3]
    assert mesh.replicas(3) == [0, 1, 2, 3] and mesh.replica_size == 4  # no tensor axis: every rank


def test_tensor_axis_innermost_and_replicas():
    mesh = ParallelMesh(data=2, tensor=2)
    assert mesh.all_groups("tensor") == [[0, 1], [2, 3]]  # a tensor group's ranks are neighbours
    assert mesh.all_groups("data") == [[0, 2], [1, 3]]
    assert mesh.replicas(1) == [1, 3] and mesh.replicas(2) == [0, 2] and mesh.replica_size == 2
    mesh = ParallelMesh(data=2, sequence=2, tensor=2)
    assert mesh.coordinates(5) == {"data": 1, "sequence": 0, "tensor": 1}
    assert mesh.rank_of(data=1, sequence=1, tensor=0) == 6
    assert mesh.replicas(5) == [1, 3, 5, 7] and mesh.replica_size == 4
    assert mesh.members("sequence", 5) == [5, 7]


def test_one_axis_and_uneven_shapes():
    assert ParallelMesh(sequence=4).all_groups("sequence") == [[0, 1, 2, 3]]
    assert ParallelMesh(sequence=4).all_groups("data") == [[0], [1], [2], [3]]
    mesh = ParallelMesh(data=4, sequence=2)
    assert mesh.coordinates(5) == {"data": 2, "sequence": 1, "tensor": 0}
    assert mesh.all_groups("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    every = sorted(r for g in mesh.all_groups("sequence") for r in g)
    assert every == list(range(8))  # each rank in exactly one group


@pytest.mark.parametrize("kwargs, text", [
    (dict(data=0), "data=0; valid: a positive int"),
    (dict(sequence=True), "sequence=True; valid: a positive int"),
    (dict(sequence=1.5), "sequence=1.5; valid: a positive int"),
])
def test_bad_sizes(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(")):
        ParallelMesh(**kwargs)


def test_bad_rank_and_axis():
    mesh = ParallelMesh(data=2, sequence=2)
    with pytest.raises(ValueError, match=r"rank=4; valid: 0..3"):
        mesh.coordinates(4)
    with pytest.raises(ValueError, match=r"axis='pipe'; valid: \['data', 'sequence', 'tensor'\]"):
        mesh.members("pipe", 0)
    with pytest.raises(ValueError, match=r"sequence=2; valid: 0..1"):
        mesh.rank_of(sequence=2)
    with pytest.raises(RuntimeError, match="no process group joined"):
        mesh.device_mesh()
