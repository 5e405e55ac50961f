"""DDP, ZeRO-1/2 and single-process training through the real Trainer equal plain PyTorch."""
import pytest
import torch

from harness import run_ranks
from tolerance import assert_no_worse_than_peer, mean_rtol
from toy import ToyModule, assert_params_close, reference
from zerotrain import Trainer


def _fit(strategy, devices, cases):
    out = {}
    for name, kw in cases.items():
        module = ToyModule(bs=kw.get("bs", 8), opt=kw.get("opt", "adamw"), n=_n(devices))
        trainer = Trainer(strategy=strategy, devices=devices, max_steps=kw["steps"],
                          accumulate_grad_batches=kw.get("accum", 1), gradient_clip_val=kw.get("clip"),
                          logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          precision=kw.get("precision", "32"))
        trainer.fit(module)
        full = trainer.full_state_dict()
        out[name] = {"params": {k.removeprefix("net."): v for k, v in full.items()},
                     "losses": module.losses, "lr": trainer.optimizer.param_groups[0]["lr"],
                     "global_step": trainer.global_step}
    return out


def _n(world_size):
    # whole global batches per epoch, a multiple of the accumulation: epochs wrap identically
    return 8 * world_size * 24


CASES = {
    "plain": {"steps": 20},
    "accum4_clip": {"steps": 20, "accum": 4, "clip": 0.5},
    "sgd_clip": {"steps": 20, "clip": 0.5, "opt": "sgd"},
}


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_matches_single_process_pytorch(tmp_path, world_size):
    results = run_ranks("test_ddp:_fit", world_size, tmp_path, timeout=240, strategy="ddp",
                        devices=world_size, cases=CASES)
    for name, kw in CASES.items():
        ref, peer = (reference(kw["steps"], world_size, accum=kw.get("accum", 1), clip=kw.get("clip"),
                               opt=kw.get("opt", "adamw"), n=_n(world_size), as_ranks=k) for k in (0, world_size))
        got = results[0][name]
        assert got["global_step"] == kw["steps"]
        # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
        assert_params_close(got["params"], ref["params"], peer["params"])
        assert got["lr"] == pytest.approx(ref["lrs"][-1])
        assert results[1][name]["params"] == {}  # full_state_dict lands on rank 0 only
        # every micro-batch's loss, averaged over ranks, equals the global batch's loss
        # tolerance: no worse than DDP's order, + 2 mean_rtol(n) for the first step's two orders of one mean
        assert_no_worse_than_peer(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                  torch.tensor(peer["losses"]), f"{name} losses",
                                  floor=2 * mean_rtol(8 * world_size * 3))  # bs x ranks samples, 3 outputs


def test_single_process_matches_pytorch(tmp_path):
    got = _fit("single", 1, {"accum4_clip": CASES["accum4_clip"]})["accum4_clip"]
    ref = reference(20, 1, accum=4, clip=0.5, n=_n(1))
    # tolerance: exact: one process, the same micro-batches, summed in the same order as plain PyTorch
    for k, v in ref["params"].items():
        assert torch.equal(got["params"][k], v), k


@pytest.mark.parametrize("strategy,world_size", [pytest.param("zero1", 3, marks=pytest.mark.slow), ("zero2", 3)])
def test_zero_through_the_trainer_matches_pytorch(tmp_path, strategy, world_size):
    cases = {"accum4_clip": CASES["accum4_clip"], "sgd_clip": CASES["sgd_clip"]}
    results = run_ranks("test_ddp:_fit", world_size, tmp_path, timeout=240, strategy=strategy,
                        devices=world_size, cases=cases)
    for name, kw in cases.items():
        ref, peer = (reference(kw["steps"], world_size, accum=kw.get("accum", 1), clip=kw.get("clip"),
                               opt=kw.get("opt", "adamw"), n=_n(world_size), as_ranks=k) for k in (0, world_size))
        # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
        assert_params_close(results[0][name]["params"], ref["params"], peer["params"])
        assert results[0][name]["lr"] == pytest.approx(ref["lrs"][-1])
