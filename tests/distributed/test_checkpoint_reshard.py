"""Online resharding: a checkpoint saved by one strategy on N ranks resumes on another strategy on
M ranks, with the same global batch, and 10 more steps give the parameters of an uninterrupted
run (plain single-process PyTorch over the same global batches), fp32, no worse than torch DDP's
order of the same sums on 4 ranks (tolerance.assert_no_worse_than_peer).

The grid: save at (zero3, 4) -> resume at (zero2, 2), (zero1, 3), (single, 1), (ddp, 2) and
(offload, 2); save at (zero2, 2) -> resume at (zero3, 4). Where zero3 is not registered, zero2 on 4
ranks stands in for it (the test names which ran).
"""
from __future__ import annotations

import os

import pytest

from harness import run_ranks
from toy import ToyModule, assert_params_close, reference
from zerotrain import ModelCheckpoint, Trainer

N_SAMPLES = 168  # 7 global batches of 24 per epoch: step 10 is mid-epoch; 168 splits over 1-4 ranks
GLOBAL_BATCH = 24


def _zero3() -> str:
    from zerotrain.strategies import registry

    return "zero3" if "zero3" in registry.available() else "zero2"


def _fit(strategy: str, world: int, steps: int, root: str, save_as: str | None = None,
         resume: str | None = None) -> dict:
    # a shuffling loader: its DistributedSampler's order is one permutation of (seed, epoch) on any
    # number of ranks, one included (an unshuffled one is shuffled on several ranks only, as Lightning)
    module = ToyModule(bs=GLOBAL_BATCH // world, n=N_SAMPLES, shuffle=True)
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, save_as),
                           filename="{step:06d}", save_top_k=-1, every_n_train_steps=steps,
                           save_last=False)] if save_as else []
    trainer = Trainer(strategy=strategy, devices=world, max_steps=steps, callbacks=cbs, logger=False,
                      enable_checkpointing=bool(save_as), enable_progress_bar=False)
    trainer.fit(module, ckpt_path=os.path.join(root, resume) if resume else None)
    full = {k.removeprefix("net."): v for k, v in trainer.full_state_dict().items()}
    return {"params": full, "step": trainer.global_step,
            "lr": trainer.optimizer.param_groups[1]["lr"], "epoch": trainer.current_epoch,
            "batches_in_epoch": trainer.state.batches_in_epoch, "cut_batches": trainer.state.cut_batches}


def _fit_many(root: str, cases: list[dict]) -> list[dict]:
    """Several runs in one spawn (the process group is made once and reused)."""
    return [_fit(root=root, **case) for case in cases]


_RUNS: dict = {}


def _spawn(tmp_path_factory, world: int, *cases: dict) -> list[dict]:
    """Spawned runs on ``world`` ranks, rank 0's results (cached: the grid's runs feed each other)."""
    key = (world, repr(cases))
    if key not in _RUNS:
        root = _RUNS.setdefault("root", str(tmp_path_factory.mktemp("reshard")))
        try:
            _RUNS[key] = run_ranks("test_checkpoint_reshard:_fit_many", world,
                                   os.path.join(root, f"logs-{len(_RUNS)}"), timeout=150, root=root,
                                   cases=[dict(c, world=world) for c in cases])[0]
        except Exception as e:  # noqa: BLE001 - cached and re-raised per test
            _RUNS[key] = e
    if isinstance(_RUNS[key], Exception):
        raise _RUNS[key]
    return _RUNS[key]


def _source(tmp_path_factory) -> dict:
    return _spawn(tmp_path_factory, 4, dict(strategy=_zero3(), steps=10, save_as="src"))[0]


# targets on one world size share a spawn
_TARGETS = {2: ("zero2", "ddp", "offload"), 3: ("zero1",), 1: ("single",)}


def _target(tmp_path_factory, strategy: str, world: int) -> dict:
    _source(tmp_path_factory)
    names = _TARGETS[world]
    runs = _spawn(tmp_path_factory, world, *[dict(strategy=n, steps=20, save_as=f"to-{n}-{world}",
                                                 resume="src/step=000010.ckpt") for n in names])
    return runs[names.index(strategy)]


def _check(got: dict, steps: int) -> None:
    ref, peer = (reference(steps, world_size=1, bs=GLOBAL_BATCH, n=N_SAMPLES, as_ranks=k, shuffle=True)
                 for k in (0, 4))
    assert got["step"] == steps
    # tolerance: a few ulps of 0.025 / (1 + 0.1 s): the same few float64 operations in another order
    assert abs(got["lr"] - 0.025 / (1 + 0.1 * steps)) < 1e-12  # the scheduler resumed too
    # tolerance: no worse than torch DDP's order on 4 ranks (the source's; each run's ranks reorder as much)
    assert_params_close(got["params"], ref["params"], peer["params"])


@pytest.mark.parametrize("target,world", [("zero2", 2), ("zero1", 3), ("single", 1), ("ddp", 2),
                                          ("offload", 2)])
def test_zero3_on_4_ranks_resumes_elsewhere(tmp_path_factory, target, world):
    _check(_source(tmp_path_factory), 10)
    resumed = _target(tmp_path_factory, target, world)
    _check(resumed, 20)
    # 20 steps of 24 samples = epoch 2, global batch 6 of 7: max_steps ended epoch 2 there, as Lightning
    # (current_epoch moves on) and a later fit would continue its 7th batch
    assert (resumed["epoch"], resumed["batches_in_epoch"], resumed["cut_batches"]) == (3, 0, 6)


@pytest.mark.slow
def test_zero2_on_2_ranks_resumes_as_zero3_on_4(tmp_path_factory):
    _target(tmp_path_factory, "zero2", 2)
    resumed = _spawn(tmp_path_factory, 4, dict(strategy=_zero3(), steps=30, resume="to-zero2-2/step=000020.ckpt"))[0]
    _check(resumed, 30)
