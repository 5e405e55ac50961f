"""Pipeline x tensor parallelism (issue 45): ``PipelineStrategy(stages=2, tensor_parallel=2)`` on 4
real processes trains the demo GPT as the plain single-process loop over the same global batches.

Ranks 0-1 are stage 0, ranks 2-3 stage 1 (``PipelineGrid``: the tensor axis innermost); each stage
is cut by ``GPT.tp_plan`` (read from the GPT before ``to_pipeline`` replaced it, matched through
the pipeline's plain names) over its tensor group; rank t of stage 0 sends its activations to rank
2 + t; the tied embedding / LM head shard joins ranks t and 2 + t; the loss is the vocabulary-parallel
cross-entropy of the last stage's sharded logits. ``trainer.full_state_dict()`` gathers every
stage's shards whole under the GPT's names. ``stages=1, tensor_parallel=2`` on 4 ranks puts two
data-parallel replicas beside the tensor axis (each replica's gradients averaged over its tensor
index's group), against the plain loop over the replicas' global batch.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop) on every parameter after
# the steps and on each step's loss; the micro-batches only reorder fp32 sums of 2 terms.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from harness import run_ranks
from test_sequence_parallel_trainer import B, LR, RTOL, STEPS, _data, _gpt  # the same demo GPT and data
from test_tensor_parallel_trainer import _reference
from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(300)
MICRO = 2
CLIP, SGD_LR = 0.05, 0.5


class PipelinedTensorGPT(TrainModule):
    """The demo GPT; the pipeline strategy calls ``to_pipeline``, which replaces it by its layers."""

    def __init__(self, opt: str = "adamw") -> None:
        super().__init__()
        self.gpt = _gpt()
        self.opt = opt
        self.micro_losses: list[float] = []

    def to_pipeline(self, num_stages: int):
        from zerotrain.strategies.pipeline import PipelineModule

        self.gpt = PipelineModule.from_modules(self.gpt.pipeline_layers(), num_stages, loss_fn=self._loss)
        return self.gpt

    def _loss(self, logits, targets):
        from zerotrain.strategies.parallel import vocab_parallel_cross_entropy

        group = self.trainer.strategy.mesh_group("tensor")
        loss = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) if group is None
                else vocab_parallel_cross_entropy(logits, targets, group))
        self.micro_losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return _optimizer(self.opt, self.parameters())

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=B, shuffle=False)


def _optimizer(opt: str, params):
    # SGD sees the gradient's scale (a wrong clipping norm shows); AdamW mostly does not
    return torch.optim.AdamW(params, lr=LR) if opt == "adamw" else torch.optim.SGD(params, lr=SGD_LR)


def _fit(stages: int, tensor_parallel: int, devices: int, clip: float | None = None, opt: str = "adamw",
         zero_stage: int = 0) -> dict:
    from zerotrain.strategies.pipeline import PipelineStrategy

    module = PipelinedTensorGPT(opt)
    strategy = PipelineStrategy(stages=stages, tensor_parallel=tensor_parallel, micro_batches=MICRO,
                                zero_stage=zero_stage, process_group_timeout_s=60)
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, precision="32", gradient_clip_val=clip)
    trainer.fit(module)
    s = trainer.strategy
    last = s.stage == s.num_stages - 1
    steps = [sum(module.micro_losses[i:i + MICRO]) / MICRO for i in range(0, len(module.micro_losses), MICRO)]
    cut = {s.pipe.plain_key(n.removeprefix("gpt.")): p.numel() for n, p in module.named_parameters()
           if hasattr(p, "tensor_parallel")}
    return {"params": {k.removeprefix("gpt."): v for k, v in trainer.full_state_dict().items()},
            "losses": steps if last else None, "stage": s.stage, "tp_rank": s.mesh_rank("tensor"),
            "replica": s.replica, "cut": cut}


def _check(results: list[dict], data_parallel: int, clip: float | None = None, opt: str = "adamw") -> None:
    ref = _reference(data_parallel, clip, SGD_LR if opt == "sgd" else None)  # the plain loop
    got = results[0]["params"]  # rank 0's full_state_dict: every stage, gathered whole
    assert set(got) == set(ref["params"])
    for name, want in ref["params"].items():
        assert got[name].shape == want.shape, name
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    for r in results:  # every stage holds half of each cut parameter
        assert r["cut"] and all(n * 2 == got[name].numel() for name, n in r["cut"].items()), r["cut"]
    per_replica: dict[int, list] = {}
    for r in results:
        if r["losses"] is not None:  # the last stage's tensor ranks: the same vocabulary-parallel loss
            per_replica.setdefault(r["replica"], []).append(r["losses"])
    assert len(per_replica) == data_parallel and all(ls[0] == ls[-1] for ls in per_replica.values())
    mean = [sum(ls[0][i] for ls in per_replica.values()) / data_parallel for i in range(STEPS)]
    assert mean == pytest.approx(ref["losses"], rel=RTOL)


@pytest.mark.slow
def test_two_stages_by_tp2_on_4_ranks_train_as_one_process(tmp_path):
    results = run_ranks("test_pipeline_tensor:_fit", 4, tmp_path, timeout=240, stages=2, tensor_parallel=2, devices=4)
    assert [(r["stage"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check(results, 1)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_two_stages_by_tp2_clipped_by_norm_train_as_the_plain_clipped_loop(tmp_path, zero_stage):
    """The clip norm counts every stage's shards on every tensor rank and the replicated
    parameters (norms, wpe) once, the tied embedding / LM head once: SGD sees a wrong norm. With
    ``zero_stage=1`` the optimizer state is partitioned over each (stage, tensor index)'s replicas
    (here one) and the norm sums the partitions the same way."""
    results = run_ranks("test_pipeline_tensor:_fit", 4, tmp_path, timeout=240, stages=2, tensor_parallel=2, devices=4,
                        clip=CLIP, opt="sgd", zero_stage=zero_stage)
    _check(results, 1, clip=CLIP, opt="sgd")


@pytest.mark.slow
def test_one_stage_by_tp2_by_two_replicas_on_4_ranks_train_as_one_process(tmp_path):
    """The data axis beside the tensor axis: tensor rank t of one replica averages with tensor rank
    t of the other."""
    results = run_ranks("test_pipeline_tensor:_fit", 4, tmp_path, timeout=240, stages=1, tensor_parallel=2, devices=4)
    assert [(r["replica"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check(results, 2)
