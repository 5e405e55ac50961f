"""A sampler of the user's own under ``use_distributed_sampler``: ``job.SamplerShard`` gives each
rank the indices pytorch-lightning 2.6's ``DistributedSamplerWrapper`` gives it (no process group:
the split is pure), and the Trainer keeps what Lightning keeps (one process, an iterable dataset,
a batch_sampler of the user's own, ``use_distributed_sampler=False``).
``tests/distributed/test_stages.py`` checks the order inside a real 2-rank fit against Lightning's."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler, TensorDataset

from zerotrain import ConfigError, Trainer
from zerotrain.trainer.launch.job import SamplerShard, distributed_loader


class EpochStrided(Sampler):
    """``n`` indices of a dataset of ``size``, every ``stride``-th, starting at the epoch."""

    def __init__(self, n: int = 31, size: int = 64, stride: int = 3) -> None:
        self.n, self.size, self.stride, self.epoch = n, size, stride, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter([(self.epoch + self.stride * i) % self.size for i in range(self.n)])


@pytest.mark.parametrize("world, shuffle, n", [(2, True, 31), (2, False, 31), (3, True, 31), (3, False, 2),
                                               (4, True, 8)])
def test_each_rank_gets_lightnings_share(world, shuffle, n, monkeypatch):
    wrapper = pytest.importorskip("lightning_fabric.utilities.distributed").DistributedSamplerWrapper
    for rank, epoch in itertools.product(range(world), (0, 1)):
        ours = SamplerShard(EpochStrided(n), world, rank, shuffle=shuffle, seed=7)
        theirs = wrapper(EpochStrided(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs), (rank, epoch)
        assert len(ours) == len(theirs) == -(-n // world)
    shares = [list(SamplerShard(EpochStrided(n), world, r)) for r in range(world)]
    assert sorted(set(i for s in shares for i in s)) == sorted(set(EpochStrided(n)))  # every index, padded


def test_a_sampler_without_a_length_is_refused():
    class Endless(Sampler):
        def __iter__(self):
            return itertools.count()

    with pytest.raises(ConfigError, match="sampler Endless has no length.*use_distributed_sampler=False"):
        SamplerShard(Endless(), 2, 0)


class _Ranks:
    """A strategy's data-parallel coordinates, for ``distributed_loader`` without processes."""

    def __init__(self, world: int, rank: int) -> None:
        self.data_parallel_world_size, self.data_parallel_rank = world, rank


def test_distributed_loader_wraps_own_samplers_only_when_asked_and_keeps_batch_samplers():
    ds = TensorDataset(torch.arange(64))
    own = DataLoader(ds, batch_size=4, sampler=EpochStrided())
    assert distributed_loader(own, _Ranks(2, 1), 0) is own  # the Engine's call: kept as before
    assert distributed_loader(own, _Ranks(1, 0), 0, custom_sampler_shuffle=True) is own  # one rank: kept
    split = distributed_loader(own, _Ranks(2, 1), 0, custom_sampler_shuffle=False)
    assert isinstance(split.sampler, SamplerShard) and split.batch_size == 4
    assert [int(i) for (b,) in split for i in b] == list(EpochStrided())[1::2] + [0]  # padded with the first
    batches = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 16, False))
    assert distributed_loader(batches, _Ranks(2, 0), 0) is batches  # once re-built unbatched


def _module():
    from zerotrain import TrainModule

    class Net(TrainModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            x = batch[0].float().view(-1, 1)
            self.log("n", float(x.shape[0]))  # the batch's rows: a re-built loader would change them
            return self.lin(x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    return Net()


class _Stream(IterableDataset):
    def __iter__(self):
        return iter((x,) for x in torch.arange(8).float())


@pytest.mark.parametrize("kind", ["shuffled, use_distributed_sampler=False", "own sampler", "own batch_sampler",
                                  "iterable dataset"])
def test_the_trainer_keeps_the_users_loader(kind):
    ds = TensorDataset(torch.arange(32).float())
    loader = {"shuffled, use_distributed_sampler=False": DataLoader(ds, batch_size=4, shuffle=True),
              "own sampler": DataLoader(ds, batch_size=4, sampler=EpochStrided(8, 32)),
              "own batch_sampler": DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 8, False)),
              "iterable dataset": DataLoader(_Stream(), batch_size=4)}[kind]
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, stall_timeout_s=None,
                      use_distributed_sampler=not kind.startswith("shuffled"))
    trainer.fit(_module(), loader)
    assert trainer.train_dataloader is loader
    assert float(trainer.callback_metrics["n"]) == (8.0 if kind == "own batch_sampler" else 4.0)
