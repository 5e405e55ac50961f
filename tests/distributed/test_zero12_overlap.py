"""Overlap in ZeRO 1/2 on 2 gloo ranks: stage 1's bucketed reduction during the synchronising
backward, and ``overlap_param_gather`` (the post-step all-gathers still in flight when
``optimizer_step`` returns; forwards and every other reader wait for them).
"""
from __future__ import annotations

import os

import torch

from harness import run_ranks
from test_zero12 import CLIP, GLOBAL_MICRO, Deep, MLP, flat, mlp_batches, reference, setup, train
from tolerance import assert_no_worse_than_peer, mean_rtol

STEPS = 8


def _stage1_overlap(rank: int, world: int) -> dict:
    model = Deep()
    strategy, _ = setup(1, model, reduce_bucket_size=32 * 32 + 32)  # one bucket per layer
    seen = {}
    start = strategy.queue.launched

    def at_first_layer(p):  # registered after the strategy's hook: runs right after it
        seen.setdefault("launched", []).append(strategy.queue.launched - start)
        seen.setdefault("pending", []).append(len(strategy.queue))

    model.layers[0].weight.register_post_accumulate_grad_hook(at_first_layer)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    with strategy.no_sync():  # accumulates locally: nothing launched
        strategy.backward(strategy.training_step((x, y), 0))
    seen["after_no_sync"] = strategy.queue.launched - start
    strategy.backward(strategy.training_step((x, y), 0))
    seen["after_sync"] = strategy.queue.launched - start
    seen["buckets"] = len(strategy.grads.buckets)
    strategy.teardown()
    return seen


def _gather_overlap(rank: int, world: int) -> dict:
    out = {}
    probe = torch.randn(6, 13, generator=torch.Generator().manual_seed(5))
    for stage in (1, 2):
        for accum in (1, 3):
            batches = mlp_batches(STEPS, accum)
            model = MLP("adamw")
            strategy, sched = setup(stage, model, reduce_bucket_size=100, allgather_bucket_size=60,
                                    overlap_param_gather=True)
            losses, _, _ = train(strategy, sched, batches, CLIP)
            case = {"in_flight": len(strategy.pending)}  # right after the last optimizer_step
            with torch.no_grad():  # a validation forward: the pre-hooks wait per module
                case["probe"] = model.net(probe).float().clone()
            case["in_flight_after_probe"] = len(strategy.pending)
            case["full"] = strategy.full_state_dict()
            case["params"] = flat(model)
            case["losses"] = torch.tensor(losses)
            strategy.teardown()
            for key, k in ((("ref", 0), ("peer", world)) if rank == 0 else ()):
                ref = MLP("adamw")
                ref_losses, _ = reference(ref, batches, CLIP, as_ranks=k)
                case[f"{key}_losses"] = torch.tensor(ref_losses)
                case[f"{key}_params"] = flat(ref)
                case[f"{key}_state"] = {k: v.clone() for k, v in ref.state_dict().items()}
                with torch.no_grad():
                    case[f"{key}_probe"] = ref.net(probe).float()
            out[f"zero{stage}_accum{accum}"] = case
    # off by default: the step returns with nothing pending
    model = MLP("adamw")
    strategy, sched = setup(2, model, allgather_bucket_size=60)
    train(strategy, sched, mlp_batches(1, 1), CLIP)
    out["default_in_flight"] = len(strategy.pending)
    strategy.teardown()
    return out


def _worker() -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {"stage1": _stage1_overlap(rank, world), "gather": _gather_overlap(rank, world)}


_SPAWNED: dict[str, object] = {}


def spawned(tmp_path_factory) -> list[dict]:
    if "r" not in _SPAWNED:
        try:
            _SPAWNED["r"] = run_ranks("test_zero12_overlap:_worker", 2, tmp_path_factory.mktemp("ov"),
                                      timeout=150)
        except Exception as e:  # noqa: BLE001 - cached and re-raised per test
            _SPAWNED["r"] = e
    if isinstance(_SPAWNED["r"], Exception):
        raise _SPAWNED["r"]
    return _SPAWNED["r"]


def test_stage1_reduces_buckets_during_the_synchronising_backward(tmp_path_factory):
    seen = spawned(tmp_path_factory)[0]["stage1"]
    assert seen["buckets"] == 6
    assert seen["after_no_sync"] == 0, seen  # no_sync(): no communication at all
    # first layer's hook: on the no_sync pass nothing launched; on the synchronising pass the
    # later layers' buckets are already launched and some still in flight
    assert seen["launched"][0] == 0, seen
    assert seen["launched"][1] >= 5 and seen["pending"][1] >= 1, seen
    assert seen["after_sync"] == 6, seen


def test_param_gather_still_in_flight_when_optimizer_step_returns(tmp_path_factory):
    ranks = spawned(tmp_path_factory)
    for res in ranks:
        for name, case in res["gather"].items():
            if name.startswith("zero"):
                assert case["in_flight"] >= 2, (name, case["in_flight"])
        assert res["gather"]["default_in_flight"] == 0


def test_overlapped_gather_reads_match_reference(tmp_path_factory):
    ranks = spawned(tmp_path_factory)
    for name, case in ranks[0]["gather"].items():
        if not name.startswith("zero"):
            continue
        # tolerance: no worse than DDP's order, + 2 mean_rtol(n) for the first step's two orders of one mean
        assert_no_worse_than_peer(case["losses"], case["ref_losses"], case["peer_losses"], f"{name} losses",
                                  floor=2 * mean_rtol(GLOBAL_MICRO * 5 * int(name[-1])))  # samples x outputs x accum
        # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
        assert_no_worse_than_peer(case["params"], case["ref_params"], case["peer_params"], f"{name} params")
        # a no-grad forward right after the step saw the updated weights
        # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
        assert_no_worse_than_peer(case["probe"], case["ref_probe"], case["peer_probe"], f"{name} probe")
        # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
        assert_no_worse_than_peer(case["full"], case["ref_state"], case["peer_state"], f"{name} ")
        for r in range(1, len(ranks)):
            assert torch.equal(ranks[r]["gather"][name]["params"], case["params"]), name
            assert torch.equal(ranks[r]["gather"][name]["probe"], case["probe"]), name
