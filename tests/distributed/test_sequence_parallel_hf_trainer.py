"""A Hugging Face Llama under sequence parallelism in the Trainer (issue 45): ``DDP(sequence_parallel=sp)``
on sp = 2 and 4 ranks, the model switched to Ulysses attention with ``use_ulysses(model, strategy.mesh_group("sequence"))``,
dict batches (``input_ids``, next-token ``labels`` with ignored positions) cut by the strategy's
default ``shard_sequence`` (which adds the whole sequence's ``position_ids``), the loss through
``sequence_loss`` over the tokens not ignored (their count differs between the shards): three AdamW
steps equal transformers' own SDPA model in the plain single-process loop.

# tolerance: rel <= 1e-5 (issue 45's bound for fp32 against the plain loop), losses and every parameter.
Skips without transformers (not a dependency of zerotrain).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from harness import run_ranks
from zerotrain import Trainer, TrainModule

pytestmark = pytest.mark.timeout(300)

B, S, N, STEPS, LR, RTOL = 2, 16, 6, 3, 1e-3, 1e-5
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


class _Tokens(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        ids = torch.randint(0, CONFIG["vocab_size"], (N, S + 1), generator=g)
        self.ids, self.labels = ids[:, :-1].clone(), ids[:, 1:].clone()
        self.labels[:, -3:] = -100  # ignored: all in the second half, so the shards count differently
        self.labels[::2, 2] = -100

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).float()


def _loss_sum(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


class LlamaModule(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.llama = _llama()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if strategy.mesh_size("sequence") > 1:
            from zerotrain.strategies.parallel import use_ulysses
            use_ulysses(self.llama, strategy.mesh_group("sequence"))

    def training_step(self, batch, batch_idx):
        labels = batch["labels"]  # this rank's shard; position_ids added by the strategy
        logits = self.llama(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = self.trainer.strategy.sequence_loss(_loss_sum(logits, labels), (labels != -100).sum())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(_Tokens(), batch_size=B, shuffle=False)


def _fit(sp: int) -> dict:
    from zerotrain.strategies import DDP

    module = LlamaModule()
    trainer = Trainer(strategy=DDP(sequence_parallel=sp), devices=sp, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, precision="32")
    trainer.fit(module)
    return {"params": {k.removeprefix("llama."): v for k, v in trainer.full_state_dict().items()},
            "losses": module.losses}


@pytest.mark.parametrize("sp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_llama_sequence_parallel_through_the_trainer_equals_one_process(tmp_path, sp):
    """sp=4: the 2 KV heads are repeated to 4 (one per rank) around the attention."""
    pytest.importorskip("transformers")
    results = run_ranks("test_sequence_parallel_hf_trainer:_fit", sp, tmp_path, timeout=280, sp=sp)
    model, data = _llama(), _Tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = {k: v[step * B:(step + 1) * B] for k, v in (("input_ids", data.ids), ("labels", data.labels))}
        loss = _loss_sum(model(input_ids=batch["input_ids"]).logits, batch["labels"]) / (batch["labels"] != -100).sum()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    got = results[0]["params"]
    for name, want in model.state_dict().items():
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= RTOL, (name, err)
    mean = [sum(r["losses"][i] for r in results) / sp for i in range(STEPS)]
    assert mean == pytest.approx(losses, rel=RTOL)
