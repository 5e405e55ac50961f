"""tests/tolerance.py, the derived tolerances of the equivalence tests: its bounds hold where they
claim to, and its check refuses an error beyond them."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tolerance import (EPS32, assert_no_worse_than_peer, backward_as_ranks, gamma, mean_rtol, rel_err,
                       shard, sum_rtol)


def test_gamma_is_highams_constant():
    assert gamma(1) == pytest.approx(EPS32 / 2 / (1 - EPS32 / 2), rel=1e-15)
    assert gamma(1000) == pytest.approx(1000 * EPS32 / 2, rel=1e-4)
    with pytest.raises(ValueError):
        gamma(2 ** 24)  # n*u >= 1: no bound


@pytest.mark.parametrize("n", [2, 17, 1000, 65536])
def test_sum_bound_holds_for_any_order(n):
    """fp32 sums of the same terms in several orders (sequential, reversed, sorted, pairwise,
    in rank-sized chunks) all stay within sum_rtol(n) x sum|terms| of the exact (float64) sum."""
    g = torch.Generator().manual_seed(n)
    for x in (torch.randn(n, generator=g), torch.rand(n, generator=g) * 1e3):  # signs mixed, and one sign
        exact, scale = float(x.double().sum()), float(x.double().abs().sum())
        orders = {"torch": x.sum(), "sorted": x.sort().values.sum(), "pairwise": x.view(-1, 1).sum(0)[0]}
        for name, perm in (("sequential", x), ("reversed", x.flip(0))):
            acc = torch.zeros((), dtype=torch.float32)
            for v in perm:
                acc = acc + v
            orders[name] = acc
        orders["chunks"] = torch.stack([c.sum() for c in x.chunk(3)]).sum()
        for name, got in orders.items():
            assert abs(float(got) - exact) <= sum_rtol(n) * scale, name


def test_mean_bound_covers_a_mean_of_rank_means():
    x = torch.rand(96, generator=torch.Generator().manual_seed(3))  # squared errors: one sign
    exact = float(x.double().mean())
    got = float(torch.stack([x[r::3].mean() for r in range(3)]).mean())
    assert abs(got - exact) <= mean_rtol(96) * exact


def test_peer_check_passes_within_and_refuses_beyond_the_bound():
    want = {"w": torch.ones(100)}
    peer = {"w": want["w"] + 8 * EPS32}  # the equally valid order is off by 8 ulps (exact in fp32)
    report = assert_no_worse_than_peer({"w": want["w"] + 35 * EPS32}, want, peer)  # bound: 4 x 8 + 4 ulps
    assert report["w"] == (pytest.approx(35 * EPS32, rel=1e-9), pytest.approx(36 * EPS32, rel=1e-9))
    with pytest.raises(AssertionError, match=r"w: relative error 4\.411e-06 > bound 4\.292e-06"):
        assert_no_worse_than_peer({"w": want["w"] + 37 * EPS32}, want, peer)
    # where the peer is exact the floor remains: a few ulps pass, 100 do not
    assert_no_worse_than_peer({"w": want["w"] + 2 * EPS32}, want, {"w": want["w"].clone()})
    with pytest.raises(AssertionError):
        assert_no_worse_than_peer({"w": want["w"] + 100 * EPS32}, want, {"w": want["w"].clone()})
    with pytest.raises(AssertionError):  # a missing tensor is an error, not a pass
        assert_no_worse_than_peer({}, want, peer)


def test_shard_is_what_a_rank_loads_under_distributed_sampler():
    data = TensorDataset(torch.arange(24.0).view(12, 2), torch.arange(12))
    whole = next(iter(DataLoader(data, batch_size=12)))
    for rank in range(3):
        loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 3, rank, shuffle=False))
        for got, want in zip(shard(whole, rank, 3), next(iter(loader))):
            assert torch.equal(got, want)


def test_backward_as_ranks_is_the_plain_gradient_in_another_order():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randn(12, 7, generator=g), torch.randn(12, 3, generator=g)) for _ in range(2)]

    def loss_fn(b):
        return nn.functional.mse_loss(net(b[0]), b[1])

    for b in micro:
        (loss_fn(b) / 2).backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    backward_as_ranks(net.parameters(), micro, loss_fn, 1)  # one rank: the same order exactly
    assert all(torch.equal(p.grad, q) for p, q in zip(net.parameters(), plain))
    net.zero_grad(set_to_none=True)
    backward_as_ranks(net.parameters(), micro, loss_fn, 3)
    for p, q in zip(net.parameters(), plain):
        assert 0 < rel_err(p.grad, q) < 1e-5  # reordered, not a different gradient
