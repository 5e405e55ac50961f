"""A small model, its data and the plain single-process PyTorch loop it must match.

The reference mirrors what the Trainer does on N ranks with per-rank batch ``bs``: each rank's
training DistributedSampler shuffles (as Lightning's, even when the loader does not; seed 0 unless
given, ``set_epoch(epoch)``), global batch b is every rank's b-th batch (``global_batches``), the
loss is the mean over it, and with accumulation the step gradient is the mean of ``accum`` such
micro-batches. One process keeps an unshuffled loader's order.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tolerance import assert_no_worse_than_peer, backward_as_ranks
from zerotrain import TrainModule


def make_data(n: int = 640, d_in: int = 12, seed: int = 1234) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, 3, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 3, generator=g)
    return TensorDataset(x, y)


def build_net(d_in: int = 12, hidden: int = 37) -> nn.Module:
    # odd sizes on purpose: uneven partitions are where sharding bugs hide
    return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, 3))


def make_optimizer(net: nn.Module, lr: float = 0.05, kind: str = "adamw"):
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5}]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    return opt, sched


class ToyModule(TrainModule):
    def __init__(self, bs: int = 8, n: int = 640, lr: float = 0.05, opt: str = "adamw", inject_inf_steps=(), shuffle: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = build_net()
        self.bs, self.n, self.lr, self.opt, self.inject_inf_steps = bs, n, lr, opt, tuple(inject_inf_steps)
        self.shuffle = shuffle
        self.losses: list[float] = []
        self.seen: list[torch.Tensor] = []  # first feature of every sample, to check data order

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x[:, 0].clone())
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.trainer.global_step in self.inject_inf_steps:
            loss = loss * float("inf")
        self.log("train_loss", loss.detach(), sync_dist=True)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        opt, sched = make_optimizer(self.net, self.lr, self.opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(self.n), batch_size=self.bs, shuffle=self.shuffle)


def global_batches(n: int, world: int, bs: int, epoch: int = 0, seed: int = 0, shuffle: bool = True) -> list:
    """The sample indices of one training epoch's global batches on ``world`` ranks: batch k is
    rank r's k-th batch of torch's ``DistributedSampler(shuffle=shuffle, seed=seed)`` after
    ``set_epoch(epoch)``, for every r, interleaved (rank r's j-th sample at ``j * world + r``), so
    ``tolerance.shard(batch, r, world)`` is rank r's own batch."""
    ranks = []
    for r in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        ranks.append(torch.tensor(list(sampler)))
    return [torch.stack([idx[k:k + bs] for idx in ranks], dim=1).flatten() for k in range(0, len(ranks[0]), bs)]


def trainer_batches(n: int, world: int, bs: int, seed: int = 0, shuffle: bool = False):
    """Endless global batches (index tensors), epoch after epoch, as the Trainer deals a training
    loader of ``n`` samples with ``shuffle`` to ``world`` ranks: its DistributedSampler shuffles on
    several ranks whatever the loader says (Lightning's rule); one process keeps the loader's order."""
    epoch = 0
    while True:
        yield from global_batches(n, world, bs, epoch, seed, shuffle=shuffle or world > 1)
        epoch += 1


def reference(steps: int, world_size: int, bs: int = 8, accum: int = 1, clip: float | None = None,
              lr: float = 0.05, opt: str = "adamw", n: int = 640, as_ranks: int = 0, seed: int = 0,
              shuffle: bool = False) -> dict:
    """Plain single-process PyTorch over the same global batches (``trainer_batches``: the loader's
    ``shuffle``, the Trainer's sampler ``seed``). ``as_ranks=k``: the peer for
    ``tolerance.assert_no_worse_than_peer``, each gradient summed as torch DDP sums it on k ranks
    (its losses are then the global batches' losses, computed alone)."""
    torch.manual_seed(0)
    net = build_net()
    optimizer, sched = make_optimizer(net, lr, opt)
    data = make_data(n).tensors
    batches = trainer_batches(n, world_size, bs, seed, shuffle)
    losses, lrs = [], []
    for _ in range(steps):
        micro = []
        for _ in range(accum):
            idx = next(batches)
            micro.append(tuple(t[idx] for t in data))
        for x, y in micro:
            with torch.set_grad_enabled(not as_ranks):
                loss = nn.functional.mse_loss(net(x), y)
            losses.append(float(loss.detach()))
            if not as_ranks:
                (loss / accum).backward()
        if as_ranks:
            backward_as_ranks(net.parameters(), micro, lambda b: nn.functional.mse_loss(net(b[0]), b[1]), as_ranks)
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        sched.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return {"params": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses, "lrs": lrs}


def assert_params_close(got: dict, want: dict, peer: dict) -> dict:
    """``got`` no worse than ``peer`` (the same case summed in another valid order, e.g.
    ``reference(..., as_ranks=k)``) against ``want``: see ``tolerance.assert_no_worse_than_peer``."""
    return assert_no_worse_than_peer(got, want, peer)
