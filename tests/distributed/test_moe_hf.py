"""Hugging Face MoE models under expert parallelism (strategies/moe/hf.py), their modules unchanged:
tiny Mixtral, Qwen2-MoE and OLMoE configs (transformers 5's experts containers, found by the
generic rule) with ep=2 on 2 real processes, under our DDP and under ZeRO-3, equal torch's
DistributedDataParallel of the same model with every expert on every rank: each rank's loss (with
the router's load-balancing loss) at every step, and the final parameters (this rank's experts
against the same global experts). fp32, 3 SGD steps, each rank its own tokens.

Tolerance, derived: an expert's gradient sums the same per-token terms in another order (one
matmul over both ranks' tokens instead of two summed by the all-reduce): fp32 eps per token of the
global batch, per step (measured: losses bit-identical, parameters within 6e-8)."""
from __future__ import annotations

import pytest
import torch

from harness import init_dist, run_ranks, set_up_like_trainer
from zerotrain.strategies import instrument
from zerotrain.trainer.api.module import TrainModule

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(400)

STEPS, BATCH, SEQ, HIDDEN, EXPERTS = 3, 2, 8, 16, 4
SMALL = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
             router_aux_loss_coef=0.1, attn_implementation="eager")
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=EXPERTS)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                       num_experts=EXPERTS, decoder_sparse_step=1, norm_topk_prob=False)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=32, num_experts=EXPERTS)),
}


def _model(arch: str):
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**SMALL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


class _LM(TrainModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def training_step(self, batch, idx):
        return self(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1), None


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _torch_ddp(arch: str, rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    lm = _LM(_model(arch))
    ddp = DistributedDataParallel(lm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = ddp(_batch(step, rank))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in lm.named_parameters()}}


class _Sink:
    def __init__(self) -> None:
        self.ops = []

    def collective(self, event) -> None:
        self.ops.append(event.op)


def _ours(arch: str, rank: int, world: int, strategy_name: str) -> dict:
    from zerotrain.strategies import DDP, ZeroStage3
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.moe.hf import use_expert_parallel
    from zerotrain.strategies.precision import Precision

    lm = _LM(_model(arch))
    placed = use_expert_parallel(lm, 2)
    strategy = {"ddp": DDP, "zero3": ZeroStage3}[strategy_name](process_group_timeout_s=60)
    set_up_like_trainer(strategy, lm, detect(world), Precision())
    losses, ops = [], []
    for step in range(STEPS):
        sink = _Sink()
        instrument.add_sink(sink)
        try:
            loss = strategy.training_step(_batch(step, rank), 0)
            strategy.backward(loss)
        finally:
            instrument.remove_sink(sink)
        strategy.optimizer_step(None)
        losses.append(loss.detach())
        ops.append(sink.ops.count("all_to_all"))
    gathered = strategy.gathered() if strategy_name == "zero3" else torch.no_grad()
    with gathered:
        params = {n: p.detach().clone() for n, p in lm.named_parameters()}
    return {"losses": losses, "params": params, "placed": placed, "all_to_all": ops}


def _ranks(arch: str) -> dict:
    rank, world = init_dist()
    ref = _torch_ddp(arch, rank)
    return {"ref": ref, **{s: _ours(arch, rank, world, s) for s in ("ddp", "zero3")}}


@pytest.mark.parametrize("arch, world", [(a, 2) for a in sorted(ARCHS)] + [pytest.param("mixtral", 4, marks=pytest.mark.slow)])
def test_hf_moe_with_expert_parallelism_equals_torch_ddp(arch, world, tmp_path):
    """ep=2 on 2 ranks, and (Mixtral) ep=2 x 2 expert-data replicas on 4."""
    results = run_ranks("test_moe_hf:_ranks", world, tmp_path, timeout=300, arch=arch)
    tol = torch.finfo(torch.float32).eps * (world * BATCH * SEQ) * STEPS
    for rank, res in enumerate(results):
        ref = res["ref"]
        for name in ("ddp", "zero3"):
            got = res[name]
            assert got["placed"] == [f"model.model.layers.{i}.mlp.experts" for i in range(2)], got["placed"]
            torch.testing.assert_close(got["losses"], ref["losses"], atol=tol, rtol=tol, msg=f"{rank} {name}")
            # per layer and step, reported to the CommsLogger/ResourceMonitor: forward the counts, the
            # routes, their expert numbers and the outputs back; backward the outputs' and routes' gradients
            assert got["all_to_all"] == [2 * 6] * STEPS, got["all_to_all"]
            for pname, value in got["params"].items():
                want = ref["params"][pname]
                if ".mlp.experts." in pname:  # the half of the experts of this rank's place
                    want = want[(rank % 2) * (EXPERTS // 2):(rank % 2 + 1) * (EXPERTS // 2)]
                torch.testing.assert_close(value, want, atol=tol, rtol=tol, msg=f"{rank} {name} {pname}")


# ---------------------------------------------------------------------------- under the Trainer
class _Fit(_LM):
    """Experts placed in ``configure_model`` (the process group exists by then; under zero3 it
    runs inside the partitioned build, which the in-place cut leaves alone)."""

    def __init__(self, ep: int) -> None:
        super().__init__(_model("mixtral"))
        self.ep, self.losses = ep, []

    def configure_model(self):
        if self.ep > 1:
            from zerotrain.moe import use_expert_parallel
            use_expert_parallel(self.model, self.ep)

    def training_step(self, batch, idx):
        loss = self(batch[0])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randint(0, 64, (16, SEQ), generator=g)), batch_size=BATCH)


def _trainer_fit(strategy: str, ep: int) -> list:
    from zerotrain import Trainer

    t = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = _Fit(ep)
    t.fit(model)
    return model.losses


@pytest.mark.slow  # ~8 s alone; the 2-rank equivalence of each architecture stays in the default suite
def test_the_trainer_fits_mixtral_with_expert_parallelism(tmp_path):
    """The Trainer (2 ranks, AdamW) with Mixtral's experts placed at ep=2 under zero3 and DDP gives
    every rank the losses of DDP with every expert everywhere."""
    want = run_ranks("test_moe_hf:_trainer_fit", 2, tmp_path / "ref", timeout=300, strategy="ddp", ep=1)
    tol = torch.finfo(torch.float32).eps * (2 * BATCH * SEQ) * STEPS
    for strategy in ("ddp", "zero3"):
        got = run_ranks("test_moe_hf:_trainer_fit", 2, tmp_path / strategy, timeout=300, strategy=strategy, ep=2)
        for rank in (0, 1):
            assert len(got[rank]) == STEPS
            torch.testing.assert_close(got[rank], want[rank], atol=tol, rtol=tol, msg=f"{strategy} rank {rank}")
