"""Sequence parallelism in the Trainer (issue 45): ``strategy=DDP(sequence_parallel=2)`` on 2 ranks
and ``ZeroStage3(sequence_parallel=2)`` on 4 ranks (dp=2 x sp=2) train the demo GPT as the plain
single-process loop over the same global batches does.

What the strategy does: its mesh (data x sequence) shards the loaders by the data axis only, so both
ranks of a sequence group get the same batch; ``local_batch`` cuts every batch tensor along the
sequence; the module attends through ``ulysses_attention`` over ``mesh_group("sequence")``, embeds
its shard at ``sequence_positions`` and returns ``sequence_loss`` (its token sum x sp / the group's
tokens), whose mean over the replicas is the global batch's mean token loss. After fit, ``test``
(the evaluation loop's own forward) cuts its batches too: its losses are the trained model's.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), on the losses and on
# every parameter after the steps.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from harness import run_ranks
from toy import global_batches
from zerotrain import Trainer, TrainModule
from zerotrain.examples.gpt import GPT, GPTConfig

pytestmark = pytest.mark.timeout(300)

B, S, N, STEPS, LR, CLIP = 2, 16, 16, 3, 1e-3, 0.5
CONFIG = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=4, n_embd=16, dropout=0.0)
RTOL = 1e-5


def _data() -> TensorDataset:
    ids = torch.randint(0, CONFIG.vocab_size, (N, S + 1), generator=torch.Generator().manual_seed(6))
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _gpt() -> GPT:
    torch.manual_seed(5)
    return GPT(CONFIG)


class GPTModule(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = _gpt()
        self.losses: list[float] = []
        self.test_losses: list[float] = []
        self._attends = False

    def test_step(self, batch, batch_idx):
        self.test_losses.append(self._loss(batch).item())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def _loss(self, batch):
        strategy = self.trainer.strategy
        if not self._attends and strategy.mesh_size("sequence") > 1:
            from zerotrain.strategies.parallel import ulysses_attention
            group = strategy.mesh_group("sequence")
            self.gpt.use_attention(lambda q, k, v: ulysses_attention(q, k, v, group))
            self._attends = True
        ids, targets = batch  # this rank's shard of every sequence
        logits, _ = self.gpt(ids, positions=strategy.sequence_positions(ids.shape[1]))
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return strategy.sequence_loss(loss_sum, targets.numel())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=B, shuffle=False)


def _fit(strategy: str, devices: int, sequence_parallel: int) -> dict:
    from zerotrain.callbacks import CommsLogger
    from zerotrain.strategies import strategy_from_name

    module, comms = GPTModule(), CommsLogger()
    trainer = Trainer(strategy=strategy_from_name(strategy, sequence_parallel=sequence_parallel), devices=devices,
                      max_steps=STEPS, gradient_clip_val=CLIP, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, precision="32", callbacks=[comms])
    trainer.fit(module)
    trainer.test(module, dataloaders=DataLoader(_data(), batch_size=B), verbose=False)
    s = trainer.strategy
    return {"test_losses": module.test_losses, "group_bytes": comms.group_bytes, "params": {k.removeprefix("gpt."): v for k, v in trainer.full_state_dict().items()},
            "losses": module.losses, "dp": s.data_parallel_world_size, "dp_rank": s.data_parallel_rank,
            "sp_rank": s.mesh_rank("sequence")}


def _reference(data_parallel: int, steps: int = STEPS) -> dict:
    """The plain loop: each global batch (the ranks' batches as the Trainer's samplers deal them)
    through the whole model, mean token loss, clipped by the gradients' norm, AdamW."""
    model, data = _gpt(), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    order = [i for epoch in range(-(-steps * B * data_parallel // N))
             for i in global_batches(N, data_parallel, B, epoch, shuffle=data_parallel > 1)]
    for idx in order[:steps]:
        ids, targets = data[idx]
        logits, _ = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    with torch.no_grad():  # the trained model on every batch of the data set, in order (the test loop)
        tests = [F.cross_entropy(model(ids)[0].reshape(-1, CONFIG.vocab_size), targets.reshape(-1)).item()
                 for ids, targets in DataLoader(data, batch_size=B)]
    return {"params": {k: v.detach() for k, v in model.state_dict().items()}, "losses": losses, "tests": tests}


def _shard_bytes() -> int:
    return B * (S // 2) * CONFIG.n_embd * 4


def _assert_equal_to_reference(results: list[dict], data_parallel: int) -> None:
    ref = _reference(data_parallel)
    got = results[0]["params"]
    assert set(got) == set(ref["params"])
    for name, want in ref["params"].items():
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    # each global batch's loss: the mean over the replicas (every rank) of their sequence losses
    world = len(results)
    mean = [sum(r["losses"][i] for r in results) / world for i in range(STEPS)]
    assert mean == pytest.approx(ref["losses"], rel=RTOL)
    if data_parallel == 1:  # every rank tests every batch (its shard of it)
        tests = [sum(r["test_losses"][i] for r in results) / world for i in range(len(ref["tests"]))]
        assert tests == pytest.approx(ref["tests"], rel=RTOL)


def test_sequence_parallel_2_on_2_ranks_equals_one_process(tmp_path):
    results = run_ranks("test_sequence_parallel_trainer:_fit", 2, tmp_path, timeout=240, strategy="ddp",
                        devices=2, sequence_parallel=2)
    assert [(r["dp"], r["dp_rank"], r["sp_rank"]) for r in results] == [(1, 0, 0), (1, 0, 1)]
    _assert_equal_to_reference(results, 1)
    # Ulysses' exchanges: per step and layer, q, k, v and the output forward and their gradients
    # backward, [B, S/2, heads, D] fp32 each; the sequence axis spans every rank: the world group
    assert results[0]["group_bytes"]["world"]["all_to_all"] == STEPS * CONFIG.n_layer * 8 * _shard_bytes()


@pytest.mark.slow
def test_dp2_by_sp2_zero3_on_4_ranks_equals_one_process(tmp_path):
    results = run_ranks("test_sequence_parallel_trainer:_fit", 4, tmp_path, timeout=280, strategy="zero3",
                        devices=4, sequence_parallel=2)
    assert [(r["dp"], r["dp_rank"], r["sp_rank"]) for r in results] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]
    _assert_equal_to_reference(results, 2)
    # the comms logger files Ulysses' exchanges under the mesh's "sequence" groups, ZeRO's under the
    # world (its replicas), nothing under "data"
    for r in results:
        assert r["group_bytes"]["sequence"] == {"all_to_all": STEPS * CONFIG.n_layer * 8 * _shard_bytes()}
        assert "all_to_all" not in r["group_bytes"]["world"] and "data" not in r["group_bytes"]


def _fit_and_save(path: str) -> None:
    """ZeRO-2 with sp=2 on 2 ranks for one epoch, then the Trainer's checkpoint."""
    from zerotrain.strategies import ZeroStage2

    trainer = Trainer(strategy=ZeroStage2(sequence_parallel=2), devices=2, max_epochs=1, gradient_clip_val=CLIP,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, precision="32")
    trainer.fit(GPTModule())
    trainer.save_checkpoint(path)


def test_a_sequence_parallel_checkpoint_resumes_in_one_process(tmp_path):
    """Parameters are replicated over the sequence axis, so the checkpoint is the usual one: an
    epoch at sp=2 (ZeRO-2, 2 ranks), resumed by one process for a second epoch, equals the plain
    loop over both epochs (parameters, and the optimizer state they depend on)."""
    ckpt = str(tmp_path / "sp2.ckpt")
    run_ranks("test_sequence_parallel_trainer:_fit_and_save", 2, tmp_path, timeout=240, path=ckpt)
    module = GPTModule()
    trainer = Trainer(strategy="single", devices=1, max_epochs=2, gradient_clip_val=CLIP, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, precision="32")
    trainer.fit(module, ckpt_path=ckpt)
    assert trainer.global_step == 2 * N // B
    ref = _reference(1, steps=2 * N // B)
    for name, want in ref["params"].items():
        got = module.gpt.state_dict()[name]
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    assert module.losses == pytest.approx(ref["losses"][N // B:], rel=RTOL)  # the second epoch's, in one process
