"""DDP, ZeRO-1/2 and single-process training through the real Trainer equal plain PyTorch."""
import pytest
import torch

from harness import run_ranks
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
        ref = reference(kw["steps"], world_size, accum=kw.get("accum", 1), clip=kw.get("clip"),
                        opt=kw.get("opt", "adamw"), n=_n(world_size))
        got = results[0][name]
        assert got["global_step"] == kw["steps"]
        assert_params_close(got["params"], ref["params"], rtol=1e-5)
        assert got["lr"] == pytest.approx(ref["lrs"][-1])
        assert results[1][name]["params"] == {}  # full_state_dict lands on rank 0 only
        # every micro-batch's loss, averaged over ranks, equals the global batch's loss
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def test_single_process_matches_pytorch(tmp_path):
    got = _fit("single", 1, {"accum4_clip": CASES["accum4_clip"]})["accum4_clip"]
    ref = reference(20, 1, accum=4, clip=0.5, n=_n(1))
    assert_params_close(got["params"], ref["params"], rtol=1e-5)


@pytest.mark.parametrize("strategy,world_size", [pytest.param("zero1", 3, marks=pytest.mark.slow), ("zero2", 3)])
def test_zero_through_the_trainer_matches_pytorch(tmp_path, strategy, world_size):
    cases = {"accum4_clip": CASES["accum4_clip"], "sgd_clip": CASES["sgd_clip"]}
    results = run_ranks("test_ddp:_fit", world_size, tmp_path, timeout=240, strategy=strategy,
                        devices=world_size, cases=cases)
    for name, kw in cases.items():
        ref = reference(kw["steps"], world_size, accum=kw.get("accum", 1), clip=kw.get("clip"),
                        opt=kw.get("opt", "adamw"), n=_n(world_size))
        assert_params_close(results[0][name]["params"], ref["params"], rtol=1e-5)
        assert results[0][name]["lr"] == pytest.approx(ref["lrs"][-1])
