"""``zerotrain.fabric.plugins.collectives`` (Lightning Fabric's path, issue 42) on one process: the
paths Lightning's examples/fabric/reinforcement_learning/train_fabric_decoupled.py imports, the op
names, the group bookkeeping, ``setup``'s address and port, and ``SingleDeviceCollective``, each
compared with the installed lightning's class. The calls over real ranks:
tests/distributed/test_fabric_collectives.py. Before, none of these paths existed."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


def _ours():
    from zerotrain.fabric.plugins import collectives

    return collectives


def test_the_paths_the_decoupled_example_imports():
    from zerotrain.fabric.plugins.collectives import Collective, SingleDeviceCollective, TorchCollective
    from zerotrain.fabric.plugins.collectives.collective import CollectibleGroup
    from zerotrain.fabric.plugins.collectives.torch_collective import TorchCollective as Same
    from zerotrain.fabric.utilities.types import CollectibleGroup as Typed

    assert Same is TorchCollective and Typed is CollectibleGroup
    assert issubclass(TorchCollective, Collective) and issubclass(SingleDeviceCollective, Collective)
    if dist.is_available():  # torch's process group is one (a structural check: size() and rank())
        assert issubclass(dist.ProcessGroup, CollectibleGroup)


@pytest.mark.parametrize("op", ["sum", "max", "MIN", "Product", "avg", "band", "bor", "bxor", "premul_sum"])
def test_op_names_are_torchs_as_lightnings(op):
    theirs = pytest.importorskip("lightning.fabric.plugins.collectives").TorchCollective
    ours = _ours().TorchCollective
    assert ours._convert_to_native_op(op) == theirs._convert_to_native_op(op) == getattr(dist.ReduceOp, op.upper())
    native = dist.ReduceOp.SUM
    assert ours._convert_to_native_op(native) is native


@pytest.mark.parametrize("op, match", [("mean", "is not a member"), (3, "Unsupported op")])
def test_unknown_ops_are_refused_as_lightnings(op, match):
    theirs = pytest.importorskip("lightning.fabric.plugins.collectives").TorchCollective
    messages = []
    for cls in (_ours().TorchCollective, theirs):
        with pytest.raises(ValueError, match=match) as e:
            cls._convert_to_native_op(op)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_group_bookkeeping():
    """One group per collective: none until ``create_group`` (a RuntimeError naming the class),
    a second ``create_group`` refused, ``teardown`` gives it back and refuses when there is none."""
    c = _ours().SingleDeviceCollective()
    with pytest.raises(RuntimeError, match="`SingleDeviceCollective` does not own a group"):
        c.group
    assert c.create_group() is c and c.group is not None
    with pytest.raises(RuntimeError, match="already owns a group"):
        c.create_group()
    assert c.teardown() is c
    with pytest.raises(RuntimeError, match="does not own a group to destroy"):
        c.teardown()


def test_single_device_calls_equal_lightnings():
    theirs = pytest.importorskip("lightning.fabric.plugins.collectives").SingleDeviceCollective()
    ours = _ours().SingleDeviceCollective()
    t, u = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    calls = [("broadcast", (t, 0)), ("all_reduce", (t, "sum")), ("reduce", (t, 0, "sum")), ("all_gather", ([u], t)),
             ("gather", (t, [u])), ("scatter", (t, [u, t])), ("reduce_scatter", (t, [u, t])),
             ("all_to_all", ([t], [u])), ("recv", (t, 0))]
    for name, args in calls:
        got, want = getattr(ours, name)(*args), getattr(theirs, name)(*args)
        assert type(got) is type(want), name
        pairs = zip(got, want) if isinstance(got, list) else [(got, want)]
        assert all(a is b for a, b in pairs), name
    assert ours.send(t, 1) is None and ours.barrier() is None
    assert (ours.rank, ours.world_size) == (theirs.rank, theirs.world_size) == (0, 1)
    assert ours.is_available() and ours.is_initialized() and ours._convert_to_native_op("x") == "x"


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_without_a_default_group_the_group_is_refused():
    """No group made and no default group running: the default group (None) is no group."""
    if dist.is_initialized():
        pytest.skip("a process group runs in this process")
    assert not _ours().TorchCollective.is_initialized()
    with pytest.raises(RuntimeError, match="`TorchCollective` does not own a group"):
        _ours().TorchCollective().rank


@pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
def test_setup_lends_the_address_and_port_for_its_call_only(monkeypatch):
    """``setup(main_address, main_port, **kwargs)``: MASTER_ADDR/MASTER_PORT set (where unset)
    while ``init_group(**kwargs)`` runs and removed after; a value already set is kept."""
    if dist.is_initialized():
        pytest.skip("a process group runs in this process")
    cls = _ours().TorchCollective
    seen = []
    monkeypatch.setattr(cls, "init_group", classmethod(lambda c, **kw: seen.append(
        (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), kw))))
    monkeypatch.setattr(cls, "manages_default_group", False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "1234")
    c = cls()
    assert c.setup(main_address="10.0.0.7", main_port=29511, backend="gloo") is c
    assert seen == [("10.0.0.7", "1234", {"backend": "gloo"})]
    assert "MASTER_ADDR" not in os.environ and os.environ["MASTER_PORT"] == "1234"
    assert cls.manages_default_group
