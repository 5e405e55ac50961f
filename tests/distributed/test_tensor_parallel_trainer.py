"""Tensor parallelism in the Trainer (issue 45): ``strategy=DDP(tensor_parallel=2)`` (or
``ZeroStage1/2/3(tensor_parallel=2)``) cuts the module by its own plan (the demo GPT's ``GPT.tp_plan``,
found inside the TrainModule) over the mesh's tensor group at set-up, and DDP averages gradients
over the replicas (the ranks with the same tensor index), ZeRO partitions and reduces over them
(ZeRO-3: each rank's local shards are what its units hold, partitioned and gathered over the
replicas only). tp=2 on 2 ranks (DDP, ZeRO-1, ZeRO-3) and dp=2 x tp=2 on 4 ranks (DDP, ZeRO-1,
ZeRO-2, ZeRO-3) train as the plain single-process loop over the same global batches; the loss is
the vocabulary-parallel cross-entropy of the sharded logits. ``trainer.full_state_dict()`` gathers
the shards back; clipping by norm takes the whole model's norm (the sharded parameters' squares
summed over the tensor group, the replicated ones counted once), under DDP and ZeRO-1/2/3;
checkpoints name and shape each parameter whole (test_tensor_parallel_checkpoint.py).

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), on the losses and on
# every parameter after the steps (test_sequence_parallel_trainer's check).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch.utils.data import DataLoader

from harness import run_ranks
from test_sequence_parallel_trainer import B, LR, N, RTOL, STEPS, _data, _gpt  # the same demo GPT and data
from toy import global_batches
from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(300)


class TensorParallelGPT(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        from zerotrain.strategies.parallel import vocab_parallel_cross_entropy

        ids, targets = batch
        logits, _ = self.gpt(ids)
        group = self.trainer.strategy.mesh_group("tensor")
        loss = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) if group is None
                else vocab_parallel_cross_entropy(logits, targets, group))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=B, shuffle=False)


def _reference(data_parallel: int, clip: float | None = None, sgd_lr: float | None = None) -> dict:
    """The plain loop over the same global batches (the Trainer's samplers' order), mean token
    loss, AdamW (SGD at ``sgd_lr`` where given); clipped by the gradients' norm with ``clip``
    (active at every step)."""
    model, data = _gpt(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if sgd_lr is None else torch.optim.SGD(model.parameters(), lr=sgd_lr)
    losses = []
    for idx in global_batches(N, data_parallel, B, shuffle=data_parallel > 1)[:STEPS]:
        ids, targets = data[idx]
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
        opt.step()
    return {"params": {k: v.detach() for k, v in model.state_dict().items()}, "losses": losses}


def _assert_equal_to_reference(results: list[dict], data_parallel: int, clip: float | None = None) -> None:
    ref = _reference(data_parallel, clip)
    got = results[0]["params"]
    assert set(got) == set(ref["params"])
    for name, want in ref["params"].items():
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    # each global batch's loss: the mean over the replicas (a tensor group's ranks agree)
    mean = [sum(r["losses"][i] for r in results) / len(results) for i in range(STEPS)]
    assert mean == pytest.approx(ref["losses"], rel=RTOL)


def _fit(tensor_parallel: int, devices: int, clip: float | None = None, strategy: str = "ddp",
         plan: str | None = None) -> dict:
    from zerotrain.strategies.ddp import DDPStrategy
    from zerotrain.strategies.zero import ZeroStage1, ZeroStage2, ZeroStage3

    module = TensorParallelGPT()
    if plan is not None:  # another of the GPT's plans (tp_plan_sequence_parallel), the same weights
        module.gpt.tp_plan = dict(getattr(module.gpt, plan))
    build = {"ddp": DDPStrategy, "zero1": ZeroStage1, "zero2": ZeroStage2, "zero3": ZeroStage3}[strategy]
    trainer = Trainer(strategy=build(tensor_parallel=tensor_parallel), devices=devices, max_steps=STEPS,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, precision="32",
                      gradient_clip_val=clip)
    trainer.fit(module)
    s = trainer.strategy
    local = {n: p.numel() for n, p in module.gpt.named_parameters()}
    c_fc = module.gpt.blocks[0].mlp.c_fc  # a checkpoint names and shapes each parameter whole
    assert s.checkpoint_model_info()["params"]["gpt.blocks.0.mlp.c_fc.weight"][0] == (c_fc.out_features, c_fc.in_features)
    return {"params": {k.removeprefix("gpt."): v for k, v in trainer.full_state_dict().items()},
            "losses": module.losses, "dp": s.data_parallel_world_size, "tp_rank": s.mesh_rank("tensor"),
            "local": local, "c_fc": type(module.gpt.blocks[0].mlp.c_fc).__name__, "ln_f": type(module.gpt.ln_f).__name__,
            "partitions": [u.layout.world_size for u in getattr(s, "units", [])]}


def _check(results: list[dict], data_parallel: int, clip: float | None = None) -> None:
    for r in results:
        assert r["dp"] == data_parallel and r["c_fc"] == "ParallelLinear"
        assert all(n == data_parallel for n in r["partitions"])  # zero3's units: over the replicas only
    full = results[0]["params"]  # full_state_dict: rank 0's, gathered whole
    assert all(r["local"][n] * 2 == full[n].numel() for r in results for n in ("blocks.0.mlp.c_fc.weight", "wte.weight"))
    _assert_equal_to_reference(results, data_parallel, clip)


def test_tp2_on_2_ranks_trains_as_one_process(tmp_path):
    results = run_ranks("test_tensor_parallel_trainer:_fit", 2, tmp_path, timeout=240, tensor_parallel=2, devices=2)
    assert [r["tp_rank"] for r in results] == [0, 1]
    _check(results, 1)


@pytest.mark.parametrize("strategy", ["zero1", pytest.param("zero3", marks=pytest.mark.slow)])
def test_tp2_under_zero_on_2_ranks_trains_as_one_process(tmp_path, strategy):
    results = run_ranks("test_tensor_parallel_trainer:_fit", 2, tmp_path, timeout=240, tensor_parallel=2, devices=2,
                        strategy=strategy)
    _check(results, 1)


CLIP = 0.05


@pytest.mark.slow
@pytest.mark.parametrize("strategy,clip", [("ddp", None), ("zero1", None), ("zero2", None), ("zero3", None),
                                           ("zero3", CLIP)])
def test_dp2_by_tp2_on_4_ranks_trains_as_one_process(tmp_path, strategy, clip):
    results = run_ranks("test_tensor_parallel_trainer:_fit", 4, tmp_path, timeout=280, tensor_parallel=2, devices=4,
                        strategy=strategy, clip=clip)
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    _check(results, 2, clip)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_tp2_clipped_by_norm_trains_as_the_plain_clipped_loop(tmp_path, strategy):
    """gradient_clip_val clips by the whole model's norm (the shards' squares summed over the
    tensor group, the replicated parameters' once): the plain loop with ``clip_grad_norm_``."""
    results = run_ranks("test_tensor_parallel_trainer:_fit", 2, tmp_path, timeout=240, tensor_parallel=2, devices=2,
                        clip=CLIP, strategy=strategy)
    _check(results, 1, CLIP)
    assert results[0]["losses"] == results[1]["losses"]
