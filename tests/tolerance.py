"""Tolerances for equivalence tests, derived from the case rather than from the machine a test was
written on (issue 40: a fixed 1e-5 passed on AVX2 and failed on AVX-512 with 1.4e-5).

Two kinds of bound, and every equivalence test states (``# tolerance: ...``) which one it uses:

* **A forward-error bound** for one computation whose only freedom is the order of an fp32 sum:
  summing n terms in any order is off by at most gamma(n-1) * sum|terms| (Higham, *Accuracy and
  Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), gamma(n) = n*u / (1 - n*u), u = eps/2.
  ``sum_rtol(n)`` is that bound relative to sum|terms| (= the result when the terms share a sign).

* **No worse than an equally valid order** for a training trajectory: after several optimizer
  steps no a-priori bound is useful (Adam divides by sqrt(v): a 1-ulp gradient change can move an
  element by ~lr, and the loss's curvature carries it on), so the distributed run is compared with
  a *peer*, the same case with its sums in the order a reference distributed implementation uses
  (each rank's local gradient, then the sum over ranks, as torch DDP), and its error against the
  plain single-process run may be at most ``PEER_FACTOR`` x the peer's error, plus ``floor_ulps``
  x eps for the final rounding. ``assert_no_worse_than_peer`` checks that, tensor by tensor.
"""
from __future__ import annotations

from typing import Mapping

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0 in fp32; unit roundoff u = eps/2

#: two valid fp32 orders of one trajectory (the rank-local sums, gloo's reduction order,
#: reduce-per-micro-batch or accumulate-then-reduce) perturb it by rounding errors of one size
#: and random sign, which the steps then amplify alike: their errors against the plain run are
#: draws of one distribution, and 4x covers the ratio of two such draws (the norm of a tensor's
#: error averages over its elements, so the ratio is near 1 for all but the smallest tensors)
PEER_FACTOR = 4.0
#: a few ulps: the rounding of the final update itself, where the peer happens to agree exactly
FLOOR_ULPS = 4.0


def gamma(n: int, eps: float = EPS32) -> float:
    """Higham's gamma_n = n*u / (1 - n*u) with u = eps/2: the relative forward-error constant of n
    floating-point operations in sequence (a sum of n+1 terms, a dot product of length n)."""
    u = eps / 2
    if n * u >= 1:
        raise ValueError(f"gamma({n}) is unbounded for eps={eps}")
    return n * u / (1 - n * u)


def sum_rtol(n: int, eps: float = EPS32) -> float:
    """Bound on |fl(sum) - sum| / sum|terms| for n terms summed in any order."""
    return gamma(max(n - 1, 1), eps)


def mean_rtol(n: int, ops: int = 2) -> float:
    """Bound on |fl(mean) - mean| / mean|terms| for a mean of n terms summed in any order and
    grouping (partial means: each rank's, then over the ranks), ``ops`` divisions rounding once each."""
    return gamma(max(n - 1, 1) + ops)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error ||got - want|| / ||want|| in float64."""
    g, w = got.detach().double(), want.detach().double()
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def peer_bound(peer_err: float, floor: float = FLOOR_ULPS * EPS32, factor: float = PEER_FACTOR) -> float:
    return factor * peer_err + floor


def assert_no_worse_than_peer(got, want, peer, what: str = "", floor: float = FLOOR_ULPS * EPS32,
                              factor: float = PEER_FACTOR) -> dict:
    """Each tensor of ``got`` (a tensor, or a mapping of them) is within ``factor`` x (the peer's
    relative error against ``want``) + ``floor`` of ``want``, norm-wise. ``floor`` defaults to
    ``FLOOR_ULPS`` ulps; a quantity the peer reproduces exactly at first (a loss before the first
    step) gets its own forward-error bound, e.g. 2 * sum_rtol(n). Returns {name: (error, bound)}."""
    if isinstance(got, torch.Tensor):
        got, want, peer = {"": got}, {"": want}, {"": peer}
    assert set(got) == set(want) == set(peer), (sorted(got), sorted(want), sorted(peer))
    report = {}
    for k in want:
        err, peer_err = rel_err(got[k], want[k]), rel_err(peer[k], want[k])
        bound = peer_bound(peer_err, floor, factor)
        report[k] = (err, bound)
        assert err <= bound, (f"{what}{k}: relative error {err:.3e} > bound {bound:.3e} ({factor:g} x the "
                              f"equally valid order's {peer_err:.3e} + {floor:.2e})")
    return report


def assert_within_sum_bound(got: torch.Tensor, want: torch.Tensor, n: int, scale: torch.Tensor | None = None,
                            what: str = "") -> None:
    """Element-wise |got - want| <= 2 sum_rtol(n) * scale: two n-term fp32 sums of the same terms in
    different orders, each within sum_rtol(n) * sum|terms| of the exact sum. ``scale`` is
    sum|terms| per element (defaults to |want|, exact when the terms share a sign)."""
    scale = want.detach().double().abs() if scale is None else scale.detach().double()
    diff = (got.detach().double() - want.detach().double()).abs()
    bound = 2 * sum_rtol(n) * scale
    worst = int((diff - bound).argmax())
    assert bool((diff <= bound).all()), (f"{what}: |error| {float(diff.flatten()[worst]):.3e} > bound "
                                         f"{float(bound.flatten()[worst]):.3e} (2 gamma({n - 1}) x sum|terms|)")


@torch.no_grad()
def nudge_one_ulp(tensors, gen: torch.Generator) -> None:
    """Move each element of each fp32 tensor one ulp up or down (signs drawn from ``gen``), in
    place: a result as valid as the one computed, which rounds each element at least once. A peer
    for a computation with no other equally valid order (an optimizer step against its reference)."""
    for t in tensors:
        up = torch.randint(0, 2, t.shape, generator=gen, dtype=torch.bool).to(t.device)  # a CPU generator
        t.copy_(torch.nextafter(t, torch.where(up, float("inf"), float("-inf"))))


# ---------------------------------------------------------------------------- the peer's order
def shard(batch, rank: int, world: int):
    """Rank ``rank``'s part of a global batch under DistributedSampler(shuffle=False): every
    ``world``-th sample from ``rank`` (contiguous, as the rank's own loader builds it)."""
    return type(batch)(t[rank::world].contiguous() for t in batch)


def backward_as_ranks(params, micro_batches, loss_fn, world: int) -> None:
    """Set each parameter's ``.grad`` the way torch DDP sums it on ``world`` ranks: every rank
    accumulates its shard of the micro-batches locally (loss / len(micro_batches)), then the ranks'
    gradients are divided by ``world`` and summed in rank order. A parameter no rank's loss
    reaches keeps ``.grad`` None, as in PyTorch."""
    backward_per_rank(params, [[shard(b, r, world) for b in micro_batches] for r in range(world)], loss_fn)


def backward_per_rank(params, rank_micro_batches, loss_fn) -> None:
    """``backward_as_ranks`` with each rank's micro-batches given (a pipeline's replicas: each
    its own batch, cut into micro-batches): rank-local sums of loss / len(micro), then the mean
    over the ranks, summed in rank order, added to ``.grad``."""
    params = [p for p in params if p.requires_grad]
    world = len(rank_micro_batches)
    local = []
    for micro_batches in rank_micro_batches:
        acc: list = [None] * len(params)
        for batch in micro_batches:
            grads = torch.autograd.grad(loss_fn(batch) / len(micro_batches), params, allow_unused=True)
            acc = [a if g is None else g if a is None else a + g for a, g in zip(acc, grads)]
        local.append(acc)
    for i, p in enumerate(params):
        parts = [acc[i] / world for acc in local if acc[i] is not None]
        if parts:
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            p.grad = total if p.grad is None else p.grad + total
