"""Checkpoints across meshes (issue 45): a checkpoint saved with a tensor axis holds every parameter
and its optimizer state whole, under its full name and shape, in the one reshardable format
(``strategies/parallel/tensor_checkpoint.py``), so a run saved under dp=2 x tp=2 (ZeRO-2, 4 ranks)
resumes under zero3 on 2 ranks (tp=1) and on one process, and one saved by zero3 on 2 ranks resumes
under dp=2 x tp=2 (ZeRO-1); each continues as the uninterrupted run: the losses of the steps after
the resume and the parameters at the end equal the run that never stopped (which saved the checkpoint).
The two checkpoints of step 2 (dp2 x tp2 and zero3) hold the same tensors under the same names.
ZeRO-3 with tp=2 (its units hold the local shards) saves and dp=2 x tp=2 under ZeRO-2 resumes (slow).
The default suite keeps one small case: tp=2 under DDP on 2 ranks saves, zero3 on the same 2 ranks
(tp=1) resumes.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), on each step's loss (the
# mean over the replicas) and on every parameter (norm of the difference / norm): the runs add the
# same gradients in other orders (tp, dp and one process split the sums differently).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

from harness import run_ranks_once
from test_sequence_parallel_trainer import N, RTOL, _data
from test_tensor_parallel_trainer import TensorParallelGPT
from zerotrain import ModelCheckpoint, Trainer

pytestmark = pytest.mark.timeout(300)

GLOBAL = 4  # samples per optimizer step (N = 16: one epoch of 4 steps)
STEPS, SAVE_AT = 4, 2


class ShuffledGPT(TensorParallelGPT):
    """The demo GPT with the vocabulary-parallel loss under a tensor axis, on a shuffling loader of
    ``GLOBAL // dp`` samples per rank: its DistributedSampler's order is one permutation of the seed
    and epoch on any number of ranks, one included, so every layout sees the same global batches."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=self.batch_size, shuffle=True)


def _strategy(name: str, tensor_parallel: int):
    from zerotrain.strategies import DDP, ZeroStage1, ZeroStage2, ZeroStage3

    if tensor_parallel == 1:
        return name
    return {"ddp": DDP, "zero1": ZeroStage1, "zero2": ZeroStage2, "zero3": ZeroStage3}[name](tensor_parallel=tensor_parallel)


def _fit(root: str, strategy: str, devices: int, tensor_parallel: int = 1, save: str | None = None,
         resume: str | None = None) -> dict:
    module = ShuffledGPT(GLOBAL * tensor_parallel // devices)
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, save), filename="{step:06d}", save_top_k=-1,
                           every_n_train_steps=SAVE_AT, save_last=False)] if save else []
    trainer = Trainer(strategy=_strategy(strategy, tensor_parallel), devices=devices, max_steps=STEPS, callbacks=cbs,
                      logger=False, enable_checkpointing=bool(save), enable_progress_bar=False, precision="32")
    trainer.fit(module, ckpt_path=os.path.join(root, resume) if resume else None)
    params = {k.removeprefix("gpt."): v for k, v in trainer.full_state_dict().items()}
    return {"losses": module.losses, "params": params, "step": trainer.global_step,
            "tp": trainer.strategy.mesh_size("tensor")}


def _fit_many(root: str, cases: list[dict]) -> list[dict]:
    """Several runs in one spawn, in order (a later one may resume an earlier one's checkpoint)."""
    return [_fit(root, **case) for case in cases]


_RUNS: dict = {}


def _root(tmp_path_factory) -> str:
    if "root" not in _RUNS:
        _RUNS["root"] = str(tmp_path_factory.mktemp("tp_ckpt"))
    return _RUNS["root"]


def _spawn(tmp_path_factory, world: int, *cases: dict) -> list[list[dict]]:
    """Every rank's results of ``cases`` run in one spawn of ``world`` ranks (cached per spawn)."""
    return run_ranks_once(_RUNS, (world, repr(cases)), "test_tensor_parallel_checkpoint:_fit_many", world,
                          tmp_path_factory, timeout=280, root=_root(tmp_path_factory), cases=list(cases))


def _losses(ranks: list[list[dict]], case: int) -> list[float]:
    """Each step's loss of the global batch: the mean over the ranks (a tensor group's agree)."""
    runs = [r[case]["losses"] for r in ranks]
    return [sum(step) / len(step) for step in zip(*runs)]


def _assert_continues(resumed: list[list[dict]], case: int, whole: list[list[dict]], whole_case: int) -> None:
    """``resumed`` (from step SAVE_AT) ends as ``whole`` (the run that saved and never stopped)."""
    assert resumed[0][case]["step"] == whole[0][whole_case]["step"] == STEPS
    assert _losses(resumed, case) == pytest.approx(_losses(whole, whole_case)[SAVE_AT:], rel=RTOL)
    got, want = resumed[0][case]["params"], whole[0][whole_case]["params"]
    assert set(got) == set(want)
    for name, w in want.items():
        err = ((got[name] - w).norm() / w.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)


def _zero3_saves(f) -> list[list[dict]]:
    return _spawn(f, 2, dict(strategy="zero3", devices=2, save="z3"))


def _tp_runs(f) -> list[list[dict]]:
    """dp=2 x tp=2 under ZeRO-2 saves; then dp=2 x tp=2 under ZeRO-1 resumes zero3's checkpoint."""
    _zero3_saves(f)
    return _spawn(f, 4, dict(strategy="zero2", devices=4, tensor_parallel=2, save="tp"),
                  dict(strategy="zero1", devices=4, tensor_parallel=2, resume=f"z3/step={SAVE_AT:06d}.ckpt"))


def assert_same_tensors(got_path: str, want_path: str, world_size: int) -> dict:
    """The checkpoint at ``got_path`` (saved by ``world_size`` ranks) holds ``want_path``'s
    parameters under the same names and shapes, each AdamW state kind and scalar equal (rel <=
    RTOL); returns ``got_path``'s parameter table."""
    from zerotrain.trainer.checkpoint.directory import load_meta
    from zerotrain.trainer.checkpoint.reshard import CheckpointReader

    (a_root, a), (b_root, b) = load_meta(got_path), load_meta(want_path)
    assert a["world_size"] == world_size and set(a["params"]) == set(b["params"])
    with CheckpointReader(a_root, a) as got, CheckpointReader(b_root, b) as want:
        for name, info in b["params"].items():
            assert a["params"][name]["shape"] == info["shape"]
            assert got.kinds(name) == want.kinds(name) == ["exp_avg", "exp_avg_sq", "param"]
            assert {k: float(v) for k, v in got.scalars(name).items()} == {k: float(v) for k, v in want.scalars(name).items()}
            n = torch.Size(info["shape"]).numel()
            for kind in want.kinds(name):
                w = want.read(name, kind, 0, n)
                err = ((got.read(name, kind, 0, n) - w).norm() / w.norm().clamp_min(1e-30)).item()
                assert err <= RTOL, (name, kind, err)
    return a["params"]


@pytest.mark.slow
def test_dp2_by_tp2_checkpoint_holds_whole_parameters_as_zero3s(tmp_path_factory):
    _tp_runs(tmp_path_factory)
    root = _root(tmp_path_factory)
    params = assert_same_tensors(*(os.path.join(root, d, f"step={SAVE_AT:06d}.ckpt") for d in ("tp", "z3")), 4)
    assert params["gpt.blocks.0.attn.c_attn.weight"]["shape"] == [48, 16]  # q, k, v whole


@pytest.mark.slow
def test_dp2_by_tp2_resumes_as_zero3_on_2_and_as_single(tmp_path_factory):
    whole = _tp_runs(tmp_path_factory)
    ckpt = f"tp/step={SAVE_AT:06d}.ckpt"
    zero3 = _spawn(tmp_path_factory, 2, dict(strategy="zero3", devices=2, resume=ckpt))
    single = _spawn(tmp_path_factory, 1, dict(strategy="single", devices=1, resume=ckpt))
    assert whole[0][0]["tp"] == 2 and zero3[0][0]["tp"] == single[0][0]["tp"] == 1
    _assert_continues(zero3, 0, whole, 0)
    _assert_continues(single, 0, whole, 0)


@pytest.mark.slow
def test_zero3_on_2_resumes_as_dp2_by_tp2(tmp_path_factory):
    whole = _zero3_saves(tmp_path_factory)
    resumed = _tp_runs(tmp_path_factory)
    assert resumed[0][1]["tp"] == 2
    _assert_continues(resumed, 1, whole, 0)


def test_tp2_under_ddp_resumes_as_zero3_with_tp1(tmp_path_factory):
    """The default suite's case: 2 ranks, tp=2 under DDP saves at step 2 and goes on; zero3 (tp=1)
    on the same 2 ranks resumes that checkpoint and ends as the run that did not stop."""
    ranks = _spawn(tmp_path_factory, 2, dict(strategy="ddp", devices=2, tensor_parallel=2, save="ddp_tp"),
                   dict(strategy="zero3", devices=2, resume=f"ddp_tp/step={SAVE_AT:06d}.ckpt"))
    assert [r[0]["tp"] for r in ranks] == [2, 2] and ranks[0][1]["tp"] == 1
    _assert_continues([[r[1]] for r in ranks], 0, [[r[0]] for r in ranks], 0)


@pytest.mark.slow
def test_zero3_with_tp2_resumes_as_dp2_by_tp2_under_zero2(tmp_path_factory):
    """ZeRO-3 with a tensor axis (its units hold the local shards) writes the same format: tp=2 under
    zero3 on 2 ranks saves; dp=2 x tp=2 under ZeRO-2 on 4 ranks resumes and ends as the run that saved."""
    whole = _spawn(tmp_path_factory, 2, dict(strategy="zero3", devices=2, tensor_parallel=2, save="z3tp"))
    resumed = _spawn(tmp_path_factory, 4, dict(strategy="zero2", devices=4, tensor_parallel=2,
                                               resume=f"z3tp/step={SAVE_AT:06d}.ckpt"))
    assert whole[0][0]["tp"] == resumed[0][0]["tp"] == 2
    _assert_continues(resumed, 0, whole, 0)
