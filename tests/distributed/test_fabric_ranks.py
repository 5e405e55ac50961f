"""zerotrain.Fabric on 2 ranks where Lightning's examples/fabric scripts found it differ from Fabric.

A loader with a sampler of the user's own (Lightning's examples/fabric/kfold_cv: a
``SubsetRandomSampler`` per fold) on 2 ranks: zerotrain.Fabric splits the sampler's indices over
the ranks as Fabric's ``DistributedSamplerWrapper`` does (its order, not shuffled again, padded from
its start); before, every rank got the whole fold. ``use_distributed_sampler=False`` keeps the
loader as it is on every rank. Compared with the installed lightning's wrapper, on the same RNG.

Started by ``fabric run`` (``LT_CLI_USED=1``; language_model/train.py: ``seed_everything(42)``, then
``Fabric()``, then the model): the ranks join the job, and re-seed from the recorded seed, in the
constructor, as Fabric's; before, they joined at the first ``setup`` and re-seeded after the model
was built, so every dropout mask differed from Fabric's."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from harness import run_ranks


def _rank_seeds() -> dict:
    from zerotrain import Fabric, seed_everything

    seed_everything(42)
    torch.rand(5)  # what the script draws before Fabric()
    fabric = Fabric()  # LT_* from the test: cpu, ddp, 2 devices, started by `fabric run`
    model = torch.nn.Linear(3, 2)
    model, _ = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    after = torch.rand(4)
    gathered = fabric.all_gather({"rank": torch.tensor([fabric.global_rank]), "half": [0.5]})  # collections
    return {"after_setup": after, "world": torch.tensor(fabric.world_size), "ranks": gathered["rank"],
            "halves": gathered["half"][0]}


@pytest.mark.timeout(200)
def test_fabric_run_joins_and_reseeds_in_the_constructor(tmp_path):
    env = {"LT_CLI_USED": "1", "LT_ACCELERATOR": "cpu", "LT_STRATEGY": "ddp", "LT_DEVICES": "2"}
    got = run_ranks("test_fabric_ranks:_rank_seeds", 2, tmp_path, timeout=150, env=env)
    torch.manual_seed(42)
    torch.nn.Linear(3, 2)  # Fabric re-seeded before the model was built
    want = torch.rand(4)
    for rank in range(2):
        assert int(got[rank]["world"]) == 2
        assert torch.equal(got[rank]["after_setup"], want), rank
        assert torch.equal(got[rank]["ranks"], torch.tensor([[0], [1]]))
        assert torch.equal(got[rank]["halves"], torch.tensor([0.5, 0.5]))


SUBSET = [2, 3, 5, 7, 8, 11, 12]  # 7 indices: padded to 8, 4 per rank


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(16)), batch_size=3, sampler=SubsetRandomSampler(SUBSET))


def _passes(loader, n: int = 2) -> list[list[int]]:
    return [[int(i) for (batch,) in loader for i in batch] for _ in range(n)]


def _rank() -> dict:
    from zerotrain import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.seed_everything(5)
    split = _passes(fabric.setup_dataloaders(_loader()))
    fabric.seed_everything(5)
    kept = _passes(fabric.setup_dataloaders(_loader(), use_distributed_sampler=False))
    return {"split": torch.tensor(split), "kept": torch.tensor(kept)}


def _lightnings(rank: int) -> list[list[int]]:
    data = pytest.importorskip("lightning.fabric.utilities.distributed")
    torch.manual_seed(5)
    inner = _loader()
    sampler = data.DistributedSamplerWrapper(inner.sampler, num_replicas=2, rank=rank, shuffle=False, seed=5)
    return _passes(DataLoader(inner.dataset, batch_size=3, sampler=sampler))


@pytest.mark.timeout(200)
def test_a_users_sampler_is_split_as_fabrics(tmp_path):
    got = run_ranks("test_fabric_ranks:_rank", 2, tmp_path, timeout=150)
    for rank in range(2):
        split = got[rank]["split"].tolist()
        assert split == _lightnings(rank), rank
        assert all(len(p) == 4 for p in split)
        torch.manual_seed(5)
        assert got[rank]["kept"].tolist() == _passes(_loader())  # every rank: the whole subset, its own order
    assert set(got[0]["split"][0].tolist() + got[1]["split"][0].tolist()) == set(SUBSET)  # one repeated: padding


class _Agent(torch.nn.Module):
    """reinforcement_learning's shape: the loop calls ``training_step`` and another method of its
    own on the set-up model, not its ``forward``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch):
        return ((self(batch[0]) - batch[1]) ** 2).mean()

    def value(self, x):
        return self(x).sum()


def _agent_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]


def _rank_forward_methods(strategy: str) -> dict:
    from zerotrain import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    agent = _Agent()
    model, opt = fabric.setup(agent, torch.optim.SGD(agent.parameters(), lr=0.5))
    model.mark_forward_method("value")
    lo, hi = fabric.global_rank * 4, (fabric.global_rank + 1) * 4
    values = []
    for x, y in _agent_batches():
        fabric.backward(model.training_step((x[lo:hi], y[lo:hi])))
        opt.step()
        with torch.no_grad():
            values.append(model.value(x))
    return {"values": torch.stack(values), **model.full_state_dict()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_training_step_and_marked_methods_run_through_the_strategy(tmp_path, strategy):
    """Under ddp ``model.training_step`` ran around torch DDP's forward, so no gradient was
    averaged (each rank stepped on its own half: fails without the change); now, as Fabric, it runs
    as the forward: the same as plain PyTorch over the global batch (within the fp32 order of the
    2-rank gradient mean). zero3 gathers per submodule, so it passed either way."""
    got = run_ranks("test_fabric_ranks:_rank_forward_methods", 2, tmp_path, timeout=240, strategy=strategy)[0]
    ref = _Agent()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    values = []
    for x, y in _agent_batches():
        opt.zero_grad()
        ref.training_step((x, y)).backward()
        opt.step()
        with torch.no_grad():
            values.append(ref.value(x))
    eps = torch.finfo(torch.float32).eps * 8  # a mean over 8 samples, summed in another order
    assert torch.allclose(got["values"], torch.stack(values), rtol=0, atol=eps * 10)
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=eps), k
    with pytest.raises(AttributeError, match="not a method"):
        from zerotrain.trainer.engine.engine import EngineModule
        EngineModule(None, ref).mark_forward_method("nothing")
