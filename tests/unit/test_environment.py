"""Where a process sits in the job, read from torchrun, SLURM or nothing (no process group)."""
import pytest

from zerotrain.strategies import environment as env
from zerotrain.strategies.environment import ProcessInfo, detect

_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RUN_ID", "ZEROTRAIN_LAUNCHED", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
         "SLURM_NODELIST", "SLURM_JOB_NAME", "SLURM_JOB_ID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)


def test_nothing_set_means_rank_zero_of_a_job_to_launch():
    info = detect(devices=4)
    assert (info.global_rank, info.world_size, info.source, info.must_launch) == (0, 4, "single", True)
    assert not detect(devices=1).must_launch


def test_torchrun_variables(monkeypatch):
    for k, v in dict(TORCHELASTIC_RUN_ID="x", RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4",
                     GROUP_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    info = detect(devices=4, num_nodes=2)
    assert info == ProcessInfo(5, 1, 8, 4, 1, "10.0.0.1", 29500, source="torchrun")


def test_slurm_variables(monkeypatch):
    for k, v in dict(SLURM_NTASKS="4", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
                     SLURM_NODELIST="gpu[007-008,010]", SLURM_JOB_NAME="train", SLURM_JOB_ID="123456",
                     SLURM_NTASKS_PER_NODE="2(x2)").items():
        monkeypatch.setenv(k, v)
    info = detect(devices=2, num_nodes=2)
    assert (info.global_rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank) == (3, 1, 4, 2, 1)
    assert info.master_addr == "gpu007" and info.source == "slurm"
    assert info.master_port == 15000 + 3456


def test_interactive_salloc_shell_is_not_a_job(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    assert detect(devices=1).source == "single"


def test_multi_node_without_a_launcher_is_a_clear_error():
    with pytest.raises(RuntimeError, match="num_nodes=2 needs a multi-node launcher"):
        detect(devices=2, num_nodes=2)


@pytest.mark.parametrize("owner", ["Trainer", "Engine"])
def test_multi_node_without_a_launcher_is_refused_when_built(owner):
    """Before any rank starts, as a configuration error naming num_nodes and the value (it failed
    at fit, with a RuntimeError traceback from the first rank's process-group set-up)."""
    from zerotrain import Trainer
    from zerotrain.trainer.engine.engine import Engine
    from zerotrain.trainer.errors import ConfigError

    build = (lambda: Trainer(num_nodes=2, devices=1, logger=False)) if owner == "Trainer" else \
        (lambda: Engine(num_nodes=2, devices=1))
    with pytest.raises(ConfigError) as info:
        build()
    msg = str(info.value)
    assert msg.startswith(f"{owner}: num_nodes=2: a multi-node job needs") and "torchrun" in msg and "SLURM" in msg, msg


def test_multi_node_under_torchrun_or_slurm_is_built(monkeypatch):
    from zerotrain import Trainer

    for k, v in dict(TORCHELASTIC_RUN_ID="x", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    assert Trainer(num_nodes=2, devices=1, logger=False).num_nodes == 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    for k, v in dict(SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_JOB_NAME="train").items():
        monkeypatch.setenv(k, v)
    assert Trainer(num_nodes=2, devices=1, logger=False).num_nodes == 2


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("n[3-5]", "n3"), ("a[01,04],b2", "a01")])
def test_slurm_first_host(nodelist, first):
    assert env._slurm_first_host(nodelist) == first
