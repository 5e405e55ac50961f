"""Pipeline x tensor parallelism checkpoints across meshes (issue 45): ``PipelineStrategy(stages=2,
tensor_parallel=2)`` on 4 ranks saves each stage's tensor-parallel parameters and their AdamW state
whole, under the plain GPT's names, in the one reshardable format (``TensorAxis(PipelineCheckpoint)``);
the tied embedding / LM head once, from stage 0. That checkpoint resumes under ``stages=2`` alone
(tp=1) on 2 ranks and as a single process, and a single process's checkpoint resumes under pp=2 x
tp=2; each continues as the run that saved it and never stopped: the losses of the steps after the
resume and every parameter at the end. The default suite keeps one small case on 2 ranks:
``stages=1, tensor_parallel=2`` saves, ``stages=2`` (tp=1) on the same ranks resumes.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), on each step's loss and
# on every parameter (norm of the difference / norm): the layouts add the same gradients in other
# orders (the tensor ranks and the micro-batches split the sums differently).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from harness import run_ranks_once
from test_sequence_parallel_trainer import LR, RTOL, _data, _gpt  # the demo GPT and its data
from test_tensor_parallel_checkpoint import GLOBAL, SAVE_AT, STEPS, assert_same_tensors
from zerotrain import ModelCheckpoint, Trainer, TrainModule

pytestmark = pytest.mark.timeout(300)
MICRO = 2


class PipeOrPlainGPT(TrainModule):
    """The demo GPT: the pipeline strategy calls ``to_pipeline`` (its loss is the last stage's
    ``_loss``), the others ``training_step``; the vocabulary-parallel loss under a tensor axis. One
    shuffled loader of the global batch (every layout here has one data-parallel replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt()
        self.losses: list[float] = []

    def to_pipeline(self, num_stages: int):
        from zerotrain.strategies.pipeline import PipelineModule

        self.gpt = PipelineModule.from_modules(self.gpt.pipeline_layers(), num_stages, loss_fn=self._loss)
        return self.gpt

    def _loss(self, logits, targets):
        from zerotrain.strategies.parallel import vocab_parallel_cross_entropy

        group = self.trainer.strategy.mesh_group("tensor")
        return (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) if group is None
                else vocab_parallel_cross_entropy(logits, targets, group))

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return self._loss(self.gpt(ids)[0], targets)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))  # the pipeline's: the batch's mean loss on every rank

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=GLOBAL, shuffle=True)


def _fit(root: str, devices: int, stages: int = 0, tensor_parallel: int = 1, save: str | None = None,
         resume: str | None = None, zero_stage: int = 0) -> dict:
    """``stages`` 0: a single process; else the pipeline with that many stages (and ``zero_stage``)."""
    from zerotrain.strategies.pipeline import PipelineStrategy

    strategy = (PipelineStrategy(stages=stages, tensor_parallel=tensor_parallel, micro_batches=MICRO,
                                 zero_stage=zero_stage, process_group_timeout_s=60) if stages else "single")
    module = PipeOrPlainGPT()
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, save), filename="{step:06d}", save_top_k=-1,
                           every_n_train_steps=SAVE_AT, save_last=False)] if save else []
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=STEPS, callbacks=cbs, logger=False,
                      enable_checkpointing=bool(save), enable_progress_bar=False, precision="32")
    trainer.fit(module, ckpt_path=os.path.join(root, resume) if resume else None)
    params = {k.removeprefix("gpt."): v for k, v in trainer.full_state_dict().items()}
    return {"losses": module.losses, "params": params, "step": trainer.global_step,
            "tp": trainer.strategy.mesh_size("tensor"), "stages": stages or 1}


def _fit_many(root: str, cases: list[dict]) -> list[dict]:
    """Several runs in one spawn, in order (a later one may resume an earlier one's checkpoint)."""
    return [_fit(root, **case) for case in cases]


_RUNS: dict = {}


def _spawn(tmp_path_factory, world: int, *cases: dict) -> list[list[dict]]:
    """Every rank's results of ``cases`` run in one spawn of ``world`` ranks (cached per spawn)."""
    if "root" not in _RUNS:
        _RUNS["root"] = str(tmp_path_factory.mktemp("pp_tp_ckpt"))
    return run_ranks_once(_RUNS, (world, repr(cases)), "test_pipeline_tensor_checkpoint:_fit_many", world,
                          tmp_path_factory, timeout=280, root=_RUNS["root"], cases=list(cases))


def _assert_continues(resumed: list[dict], whole: list[dict]) -> None:
    """``resumed`` (rank 0's run from step SAVE_AT) ends as ``whole`` (rank 0's run that saved)."""
    assert resumed[0]["step"] == whole[0]["step"] == STEPS
    assert len(whole[0]["losses"]) == STEPS and len(resumed[0]["losses"]) == STEPS - SAVE_AT
    assert resumed[0]["losses"] == pytest.approx(whole[0]["losses"][SAVE_AT:], rel=RTOL)
    for run in (resumed, whole):  # the pipeline's loss of a step is the same on every rank
        assert all(r["losses"] == run[0]["losses"] for r in run)
    got, want = resumed[0]["params"], whole[0]["params"]
    assert set(got) == set(want) and "wte.weight" in want
    for name, w in want.items():
        assert got[name].shape == w.shape, name
        err = ((got[name] - w).norm() / w.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)


def _ckpt(name: str) -> str:
    return f"{name}/step={SAVE_AT:06d}.ckpt"


def _single_saves(f) -> list[list[dict]]:
    return _spawn(f, 1, dict(devices=1, save="single"))


def _pp2_tp2_runs(f) -> list[list[dict]]:
    """pp=2 x tp=2 saves and goes on; then pp=2 x tp=2 resumes the single process's checkpoint."""
    _single_saves(f)
    return _spawn(f, 4, dict(devices=4, stages=2, tensor_parallel=2, save="pptp"),
                  dict(devices=4, stages=2, tensor_parallel=2, resume=_ckpt("single")))


@pytest.mark.slow
@pytest.mark.timeout(600)  # up to four spawns when run alone
def test_pp2_by_tp2_checkpoint_holds_whole_parameters_as_a_single_process(tmp_path_factory):
    _pp2_tp2_runs(tmp_path_factory)
    root = _RUNS["root"]
    params = assert_same_tensors(os.path.join(root, _ckpt("pptp")), os.path.join(root, _ckpt("single")), 4)
    assert params["gpt.blocks.0.attn.c_attn.weight"]["shape"] == [48, 16]  # q, k, v whole
    assert params["gpt.wte.weight"]["shape"] == [32, 16]  # the tied embedding / LM head, whole, once


@pytest.mark.slow
@pytest.mark.timeout(600)  # up to four spawns when run alone
def test_pp2_by_tp2_resumes_as_pp2_on_2_and_as_single(tmp_path_factory):
    whole = _pp2_tp2_runs(tmp_path_factory)
    pp2 = _spawn(tmp_path_factory, 2, dict(devices=2, stages=2, resume=_ckpt("pptp")))
    single = _spawn(tmp_path_factory, 1, dict(devices=1, resume=_ckpt("pptp")))
    assert (whole[0][0]["stages"], whole[0][0]["tp"]) == (2, 2) and (pp2[0][0]["stages"], pp2[0][0]["tp"]) == (2, 1)
    _assert_continues([r[0] for r in pp2], [r[0] for r in whole])
    _assert_continues([r[0] for r in single], [r[0] for r in whole])


@pytest.mark.slow
@pytest.mark.timeout(600)  # up to four spawns when run alone
def test_single_resumes_as_pp2_by_tp2(tmp_path_factory):
    whole = _single_saves(tmp_path_factory)
    resumed = _pp2_tp2_runs(tmp_path_factory)
    assert (resumed[0][1]["stages"], resumed[0][1]["tp"]) == (2, 2)
    _assert_continues([r[1] for r in resumed], [r[0] for r in whole])


def test_one_stage_tp2_resumes_as_two_stages(tmp_path_factory):
    """The default suite's case: 2 ranks, one stage cut over tp=2 saves at step 2 and goes on;
    two stages (tp=1) on the same 2 ranks resume that checkpoint and end as the run that did not stop."""
    ranks = _spawn(tmp_path_factory, 2, dict(devices=2, stages=1, tensor_parallel=2, save="tp2"),
                   dict(devices=2, stages=2, resume=_ckpt("tp2")))
    assert [r[0]["tp"] for r in ranks] == [2, 2] and ranks[0][1]["tp"] == 1
    _assert_continues([r[1] for r in ranks], [r[0] for r in ranks])


@pytest.mark.slow
@pytest.mark.timeout(600)  # up to four spawns when run alone
def test_single_resumes_as_one_stage_tp2_on_2_with_and_without_zero1(tmp_path_factory):
    """The load's cut on 2 ranks: each tensor rank of the one stage reads its shard of the single
    process's whole tensors (the tied embedding / LM head included) and continues as it; under
    ``zero_stage=1`` into its partition of the masters and state. One stage x tp=2 under ZeRO-1 saves
    too, and one process resumes it (the optimizer's groups are named from ZeRO-1's flat buffers)."""
    whole = _single_saves(tmp_path_factory)
    tp2 = dict(devices=2, stages=1, tensor_parallel=2)
    runs = _spawn(tmp_path_factory, 2, dict(tp2, resume=_ckpt("single")),
                  dict(tp2, zero_stage=1, resume=_ckpt("single")), dict(tp2, zero_stage=1, save="tpz1"))
    assert [r[0]["tp"] for r in runs] == [2, 2]
    for case in (0, 1):
        _assert_continues([r[case] for r in runs], [r[0] for r in whole])
    again = _spawn(tmp_path_factory, 1, dict(devices=1, resume=_ckpt("tpz1")))
    _assert_continues([r[0] for r in again], [r[2] for r in runs])
