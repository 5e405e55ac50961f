"""Lightning's ``ModelParallelStrategy`` (issue 45), its checks on one process: the options and the
mesh sizes refused before any rank starts, the mesh asked for too early, a module without
``configure_model`` or wrapped in FSDP1, the meta-device build materialized at set-up, and the
module's ``device_mesh``. The training itself: tests/distributed/test_model_parallel_trainer.py."""
from __future__ import annotations

import datetime

import pytest
import torch
from torch import nn

import zerotrain
from zerotrain import TrainModule
from zerotrain import ConfigError
from zerotrain.strategies import ModelParallelStrategy
from zerotrain.strategies.model_parallel.strategy import materialize, mesh_shape


def test_the_lightning_import_path_and_defaults():
    from zerotrain.strategies import ModelParallelStrategy as named

    s = named()
    assert named is ModelParallelStrategy and (s.data_parallel_size, s.tensor_parallel_size) == ("auto", "auto")
    assert ModelParallelStrategy(timeout=datetime.timedelta(seconds=30)).process_group_timeout_s == 30.0


@pytest.mark.parametrize("kwargs, match", [
    ({"data_parallel_size": 0}, r"data_parallel_size=0; valid: 'auto' or a whole number >= 1"),
    ({"tensor_parallel_size": "2"}, r"tensor_parallel_size='2'; valid: 'auto' or a whole number >= 1"),
    ({"save_distributed_checkpoint": False}, r"save_distributed_checkpoint=False; valid: True"),
    ({"process_group_backend": "mpi"}, r"process_group_backend='mpi'; valid: None, 'gloo' \(CPU\), 'nccl' \(CUDA\)"),
])
def test_bad_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelParallelStrategy(**kwargs)


def test_mesh_sizes_resolve_as_lightning_and_are_checked_before_any_rank_starts():
    assert mesh_shape("auto", "auto", 8, per_node=4) == (2, 4)  # tensor within a node, data over nodes
    assert mesh_shape(2, "auto", 8) == (2, 4) and mesh_shape("auto", 2, 8) == (4, 2) and mesh_shape(1, 2, 2) == (1, 2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 does not make the job's 2 "
                                         r"processes"):
        ModelParallelStrategy(2, 2).check_world_size(2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=auto does not make the job's 3 processes"):
        ModelParallelStrategy(2, "auto").check_world_size(3)
    ModelParallelStrategy().check_world_size(3)
    with pytest.raises(ConfigError, match=r"Trainer: ModelParallelStrategy: data_parallel_size=2 x "):
        zerotrain.Trainer(strategy=ModelParallelStrategy(2, 2), devices=2, logger=False)
    with pytest.raises(ConfigError, match=r"precision='16-mixed'; valid: 32, bf16-mixed, bf16-true"):
        zerotrain.Trainer(strategy=ModelParallelStrategy(), precision="16-mixed", logger=False)


def test_the_mesh_before_the_processes_join_is_an_error():
    with pytest.raises(RuntimeError, match=r"device_mesh: the mesh exists once the processes have joined"):
        ModelParallelStrategy().device_mesh


class _Plain(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


def test_a_module_without_configure_model_is_refused():
    with pytest.raises(TypeError, match=r"_Plain does not override configure_model\(\); parallelize the model there"):
        ModelParallelStrategy().configure_model(_Plain())
    assert _Plain().device_mesh is None  # Lightning's default: no strategy lent one


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_a_meta_build_is_materialized_by_reset_parameters():
    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(3, 3), _NoReset())
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"_NoReset has no reset_parameters\(\)"):
        materialize(module, torch.device("cpu"))
    assert not any(p.is_meta for p in module.parameters())
    torch.manual_seed(0)
    assert torch.equal(module[0].weight, nn.Linear(3, 3).weight)  # its own init, from the same RNG state


def test_a_partly_meta_build_keeps_its_real_tensors():
    """Only the submodules holding meta tensors are given storage and re-initialized: weights
    loaded (or computed) before set-up survive, as Lightning materializes."""
    real = nn.Linear(3, 3)
    with torch.no_grad():
        real.weight.fill_(7.0)
    with torch.device("meta"):
        late = nn.Linear(3, 2)
    module = nn.Sequential(real, late)
    module.register_buffer("table", torch.arange(4.0))
    materialize(module, torch.device("cpu"))
    assert torch.equal(real.weight, torch.full((3, 3), 7.0)) and torch.equal(module.table, torch.arange(4.0))
    assert not late.weight.is_meta and late.weight.abs().max() <= 1 / 3 ** 0.5  # its own reset_parameters


def test_init_module_with_empty_init_builds_on_meta_only_for_it():
    trainer = zerotrain.Trainer(strategy=ModelParallelStrategy(), logger=False)
    with trainer.init_module(empty_init=True):
        assert nn.Linear(2, 2).weight.is_meta
    with zerotrain.Trainer(strategy="single", logger=False).init_module(empty_init=True):
        assert not nn.Linear(2, 2).weight.is_meta  # elsewhere: built and initialised as usual


def test_trainer_print_is_lightnings(capsys):
    zerotrain.Trainer(logger=False).print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"


def test_only_global_rank_0_writes_a_dtensor_checkpoint():
    """Every DTensor is written whole by global rank 0; on a data=2 x tensor=2 mesh rank 1 (tensor
    index 1) is the first of its replicas too, but writes nothing: ``writes_shard`` says so."""
    from types import SimpleNamespace

    from zerotrain.strategies.model_parallel.checkpoint import DTensorCheckpoint
    from zerotrain.strategies.parallel.mesh import ParallelMesh

    mesh = ParallelMesh(data=2, tensor=2)
    for rank in range(4):
        s = SimpleNamespace(is_global_zero=rank == 0, replica_rank=mesh.replicas(rank).index(rank))
        assert DTensorCheckpoint(s).writes_shard() is (rank == 0), rank
