"""Lightning Fabric's ``TorchCollective`` and ``DDPStrategy(process_group=...)``, as Lightning's
examples/fabric/reinforcement_learning/train_fabric_decoupled.py uses them (issue 42): rank 0 a
"player" that sends data over the whole job, the other ranks "trainers" whose DDP averages over a
group of their own.

``zerotrain.fabric.plugins.collectives.TorchCollective`` runs each call on 2 ranks (the default
group, a group of its own, a group rank 0 is not in) with the values the calls must produce and
(the slow case, which imports lightning in each rank) what the installed lightning's class gives
for the same calls on the same ranks (every tensor equal). Before, the path did not exist.

``DDPStrategy(process_group=g)`` on 3 ranks, ``g`` = ranks 1 and 2, rank 0 sending each its batches
over the whole job while they set up (trainer 2 one batch fewer, trained under torch's ``Join`` with
``model._forward_module`` as the example does): the trainers' weights equal torch's own
``DistributedDataParallel(process_group=g)`` under ``Join`` on the same batches, bit for bit (the
same reducer, the same arithmetic), equal on ranks 1 and 2 and unlike either rank's training alone;
rank 0's world calls arrive intact (the Engine ran no collective over the whole job in set-up or step).
Before, ``process_group=`` was refused (``TypeError: ... is not an option``)."""
from __future__ import annotations

import os

import pytest
import torch

from harness import run_ranks


def _calls(collective, rank: int) -> dict:
    """The same calls for ours and for Lightning's class (a collective over every rank)."""
    import torch.distributed as dist

    c, out = collective, {}
    out["rank"], out["world"] = torch.tensor(c.rank), torch.tensor(c.world_size)
    out["broadcast"] = c.broadcast(torch.arange(3.0) + 10 * rank, src=1)
    out["sum"] = c.all_reduce(torch.tensor([1.0, 2.0]) * (rank + 1))
    out["max"] = c.all_reduce(torch.tensor([5.0 - rank, rank]), op="max")
    out["min"] = c.all_reduce(torch.tensor([5.0 - rank, rank]), op=dist.ReduceOp.MIN)
    out["reduce"] = c.reduce(torch.tensor([3.0 + rank]), dst=1, op="Sum")
    out["all_gather"] = torch.stack(c.all_gather([torch.zeros(2) for _ in range(2)], torch.full((2,), rank + 0.5)))
    gather = [torch.zeros(1) for _ in range(2)] if rank == 0 else []
    out["gather"] = torch.cat(c.gather(torch.tensor([7.0 * rank]), gather, dst=0) or [torch.zeros(0)])
    scatter = [torch.tensor([4.0]), torch.tensor([9.0])] if rank == 1 else None
    out["scatter"] = c.scatter(torch.zeros(1), scatter, src=1)
    out["all_to_all"] = torch.cat(c.all_to_all([torch.zeros(1), torch.zeros(1)],
                                               [torch.tensor([10.0 * rank]), torch.tensor([10.0 * rank + 1])]))
    if rank == 0:
        c.send(torch.tensor([42.0]), dst=1, tag=3)
        out["recv"] = torch.zeros(1)
    else:
        out["recv"] = c.recv(torch.zeros(1), src=0, tag=3)
    out["gathered_objects"] = c.all_gather_object([None, None], {"r": rank})
    out["broadcast_objects"] = c.broadcast_object_list([{"from": rank}, rank], src=1)
    out["gather_object"] = c.gather_object(("g", rank), [None, None] if rank == 1 else None, dst=1)
    out["scatter_objects"] = c.scatter_object_list([None], [["a"], ["b"]] if rank == 0 else [None, None], src=0)
    c.barrier()
    c.monitored_barrier()
    return out


def _rank_collectives(compare: bool) -> dict:
    """``compare``: the same calls again with Lightning's class (importing lightning takes a rank
    most of this test's time)."""
    import torch.distributed as dist

    from zerotrain.fabric.plugins.collectives import TorchCollective as Ours

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    started = Ours().setup(backend="gloo", init_method=f"file://{os.environ['ZT_TEST_RENDEZVOUS']}.c",
                           rank=rank, world_size=world)
    record = {"managed": Ours.manages_default_group}
    ours = Ours().create_group()
    record["ours"] = _calls(ours, rank)
    # a group rank 0 is not in: -1 there, and its barrier returns at once (rank 1 alone waits on it)
    solo = Ours().create_group(ranks=[1])
    record["solo"] = torch.tensor([solo.rank, solo.world_size])
    solo.barrier()
    collectives = [solo, ours]
    if compare:
        from lightning.fabric.plugins.collectives import TorchCollective as Theirs

        theirs = Theirs().create_group()
        record["theirs_managed"] = Theirs.manages_default_group
        record["theirs"] = _calls(theirs, rank)
        solo_theirs = Theirs().create_group(ranks=[1])
        record["solo_theirs"] = torch.tensor([solo_theirs.rank, solo_theirs.world_size])
        solo_theirs.barrier()
        collectives[:0] = [solo_theirs, theirs]
    kept = ours.new_group(ranks=[0, 1])  # made and handed back: the collective keeps its own group
    record["kept_own_group"] = ours.group is not kept
    for c in collectives:
        c.teardown()
    Ours.destroy_group(kept)
    started.teardown()  # owned the default group (first use): destroyed, as setup started it
    record["left_running"] = dist.is_initialized()
    return record


def _check(got: list) -> None:
    want = {  # what each call must give, per rank (a reduce leaves the other ranks' tensors undefined)
        0: {"rank": 0, "broadcast": [10.0, 11.0, 12.0], "gather": [0.0, 7.0],
            "scatter": [4.0], "all_to_all": [0.0, 10.0], "recv": [0.0]},
        1: {"rank": 1, "broadcast": [10.0, 11.0, 12.0], "reduce": [7.0], "gather": [], "scatter": [9.0],
            "all_to_all": [1.0, 11.0], "recv": [42.0]},
    }
    for rank in range(2):
        r = got[rank]
        assert r["managed"] and r["kept_own_group"] and not r["left_running"]
        ours = r["ours"]
        for key, value in want[rank].items():
            assert ours[key].tolist() == value, (rank, key)
        assert int(ours["world"]) == 2
        assert ours["sum"].tolist() == [3.0, 6.0] and ours["max"].tolist() == [5.0, 1.0]
        assert ours["min"].tolist() == [4.0, 0.0]
        assert ours["all_gather"].tolist() == [[0.5, 0.5], [1.5, 1.5]]
        assert ours["gathered_objects"] == [{"r": 0}, {"r": 1}]
        assert ours["broadcast_objects"] == [{"from": 1}, 1]
        assert ours["gather_object"] == ([("g", 0), ("g", 1)] if rank == 1 else None)
        assert ours["scatter_objects"] == [["a"] if rank == 0 else ["b"]]
        assert r["solo"].tolist() == ([-1, -1] if rank == 0 else [0, 1])


@pytest.mark.timeout(200)
def test_torch_collective_calls(tmp_path):
    _check(run_ranks("test_fabric_collectives:_rank_collectives", 2, tmp_path, timeout=150, compare=False))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torch_collective_calls_equal_lightnings(tmp_path):
    pytest.importorskip("lightning.fabric.plugins.collectives")
    got = run_ranks("test_fabric_collectives:_rank_collectives", 2, tmp_path, timeout=350, compare=True)
    _check(got)
    for rank in range(2):
        r = got[rank]
        assert not r["theirs_managed"]  # its setup was not what started the group
        assert r["ours"].keys() == r["theirs"].keys()
        for key, value in r["ours"].items():
            assert type(value) is type(r["theirs"][key]), key
            if torch.is_tensor(value):
                assert torch.equal(value, r["theirs"][key]), (rank, key)
            else:
                assert value == r["theirs"][key], (rank, key)
        assert r["solo"].tolist() == r["solo_theirs"].tolist()


STEPS = 3


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _trainer_batch(step: int, trainer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Trainer 2 has one batch fewer (the example's uneven split, under torch's ``Join``)."""
    if trainer == 2 and step == STEPS - 1:
        return None
    g = torch.Generator().manual_seed(100 * step + trainer)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _train(model, opt, batches, backward) -> None:
    for x, y in batches:
        opt.zero_grad()
        backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()


def _batches(trainer: int) -> list:
    return [b for b in (_trainer_batch(step, trainer) for step in range(STEPS)) if b is not None]


def _rank_subgroup_ddp() -> dict:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from zerotrain.fabric import Fabric
    from zerotrain.fabric.plugins.collectives import TorchCollective
    from zerotrain.fabric.strategies import DDPStrategy

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    everyone = TorchCollective().setup(backend="gloo", init_method=f"file://{os.environ['ZT_TEST_RENDEZVOUS']}.d",
                                       rank=rank, world_size=world).create_group()
    trainers = everyone.new_group(ranks=list(range(1, world)))
    if rank == 0:  # the player: world calls only, while the trainers set up and train
        fabric = Fabric(accelerator="cpu", devices=world)
        everyone.scatter_object_list([None], [None] + [_batches(t) for t in range(1, world)], src=0)
        return {"total": fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum")}
    fabric = Fabric(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group=trainers))
    net = _net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.3))
    box = [None]
    everyone.scatter_object_list(box, [None] * world, src=0)
    with Join([model._forward_module]):  # as the example: Fabric's name for the DDP module
        _train(model, opt, box[0], fabric.backward)
    total = fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum")

    ref = DistributedDataParallel(_net(), process_group=trainers)  # torch's own, the same batches
    with Join([ref]):
        _train(ref, torch.optim.SGD(ref.parameters(), lr=0.3), _batches(rank), torch.Tensor.backward)
    alone = _net()  # this rank's batches without averaging
    _train(alone, torch.optim.SGD(alone.parameters(), lr=0.3), _batches(rank), torch.Tensor.backward)
    return {"total": total, "received": torch.stack([torch.cat(b, 1) for b in box[0]]),
            "weights": dict(model.module.state_dict()), "ref": dict(ref.module.state_dict()),
            "alone": dict(alone.state_dict())}


@pytest.mark.timeout(300)
def test_ddp_over_a_sub_group_averages_within_it(tmp_path):
    got = run_ranks("test_fabric_collectives:_rank_subgroup_ddp", 3, tmp_path, timeout=240)
    assert [float(r["total"]) for r in got] == [3.0, 3.0, 3.0]  # the world all-reduce after training
    for rank in (1, 2):
        r = got[rank]
        want = torch.stack([torch.cat(b, 1) for b in _batches(rank)])
        assert torch.equal(r["received"], want), rank  # every world call reached the trainers intact
        for name, w in r["weights"].items():
            assert torch.equal(w, r["ref"][name]), (rank, name)  # torch DDP over the same group
            assert torch.equal(w, got[1]["weights"][name]), (rank, name)
            assert not torch.equal(w, r["alone"][name]), (rank, name)  # the group's average, not one rank's
