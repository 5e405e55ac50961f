"""ZeRO-3 with expert parallelism (strategies/zero/stage3/experts.py): ep=2 on 2 real processes
and ep=2 x 2 expert-data replicas on 4 equal the plain single-process loop with every expert
local (fp32, 3 SGD steps).

The model: two blocks of a dense linear layer and an MoE layer (4 experts, 2 per rank), a dense
layer before them. Each rank trains on its own tokens; the reference runs every rank's tokens
through the all-expert model with that rank's seed (the same gate draws), each loss divided by the
world size (DDP's average), and steps once. Compared: every step's loss and aux loss, and the final
parameters (this rank's experts against the reference's experts of the same global index).
Cases: top-1 with a capacity that drops tokens and random token selection, top-2 without
dropping, and the dropping case with the gradient norm clipped (the norm joins both ranks' experts).
Tolerance: fp32 eps times the hidden size, the expert width, the ranks summed and the steps."""
from __future__ import annotations

import pytest
import torch

from harness import init_dist, run_ranks, set_up_like_trainer
from zerotrain.strategies.moe import GateConfig, MoE
from zerotrain.trainer.api.module import TrainModule

pytestmark = pytest.mark.timeout(300)

HIDDEN, EXPERTS, WIDTH, STEPS = 8, 4, 16, 3
CASES = {
    "top1_rts_drop": (dict(k=1, capacity_factor=0.75, min_capacity=1), None),
    "top2_nodrop": (dict(k=2, drop_tokens=False), None),
    "top1_rts_drop_clip": (dict(k=1, capacity_factor=0.75, min_capacity=1), 0.05),
}


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, HIDDEN))


class _Block(torch.nn.Module):
    def __init__(self, ep: int, gate: dict) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep, gate=GateConfig(**gate))

    def forward(self, x):
        out, l_aux, _ = self.moe(torch.tanh(self.lin(x)))
        return x + out, l_aux


class _Net(TrainModule):
    def __init__(self, ep: int, gate: dict) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.blocks = torch.nn.ModuleList(_Block(ep, gate) for _ in range(2))
        self.aux: list[torch.Tensor] = []

    def training_step(self, batch, idx):
        x, w = batch
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        self.aux.append(aux.detach())
        return (h * w).mean() + 0.1 * aux

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5), None


def _global(name: str, rank: int, local: int) -> str:
    """A local expert's name -> the all-experts model's name of the same expert."""
    if ".experts.experts." not in name:
        return name
    prefix, rest = name.split(".experts.experts.")
    idx, tail = rest.split(".", 1)
    return f"{prefix}.experts.experts.{int(idx) + (rank % 2) * local}.{tail}"


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own tokens
    return torch.randn(2, 6, HIDDEN, generator=gen), torch.randn(2, 6, HIDDEN, generator=gen)


def _case(rank: int, world: int, gate: dict, clip: float | None) -> dict:
    from zerotrain.strategies import ZeroStage3
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision

    torch.manual_seed(0)
    full = _Net(1, gate)
    g = torch.Generator().manual_seed(5)
    full.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in full.state_dict().items()})
    start = {k: v.clone() for k, v in full.state_dict().items()}
    # the plain loop: every rank's tokens through every expert, one process
    opt = torch.optim.SGD(full.parameters(), lr=0.5)
    ref_losses, ref_aux = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for s in range(world):
            torch.manual_seed(7 + 10 * step + s)  # the gate's draws of rank s
            loss = full.training_step(_batch(step, s), 0)
            (loss / world).backward()
            if s == rank:
                ref_losses.append(loss.detach())
                ref_aux.append(full.aux[-1])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(full.parameters(), clip)
        opt.step()
    # zero3, ep=2: this rank's experts of the same starting values
    part = _Net(2, gate)
    local = EXPERTS // 2
    part.load_state_dict({k: start[_global(k, rank, local)] for k in part.state_dict()})
    strategy = ZeroStage3(process_group_timeout_s=60)
    set_up_like_trainer(strategy, part, detect(world), Precision())
    losses = []
    for step in range(STEPS):
        torch.manual_seed(7 + 10 * step + rank)
        loss = strategy.training_step(_batch(step, rank), 0)
        strategy.backward(loss)
        strategy.optimizer_step(clip)
        losses.append(loss.detach())
    with strategy.gathered():
        got = {k: v.detach().clone() for k, v in part.named_parameters()}
    kinds = {u.name: (u.has_own_group, u.layout.world_size, len(u.params)) for u in strategy.units}
    return {"losses": losses, "aux": part.aux, "ref_losses": ref_losses, "ref_aux": ref_aux, "params": got,
            "want": {k: full.state_dict()[_global(k, rank, local)] for k in got}, "kinds": kinds}


def _ranks() -> dict:
    rank, world = init_dist()
    return {case: _case(rank, world, gate, clip) for case, (gate, clip) in CASES.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_with_expert_parallelism_equals_the_plain_loop(tmp_path, world):
    """ep=2 on 2 ranks (each expert on one rank: never gathered) and ep=2 x 2 expert-data replicas
    on 4 (each expert partitioned over its 2 replicas, gathered and reduce-scattered there)."""
    results = run_ranks("test_moe_zero3:_ranks", world, tmp_path, timeout=240)
    tol = 8 * torch.finfo(torch.float32).eps * HIDDEN * WIDTH * world * STEPS
    for rank, res in enumerate(results):
        for case, r in res.items():
            expert_units = {n: k for n, k in r["kinds"].items() if k[0]}
            # one unit per local expert (a ModuleList child), each over its expert-data-parallel group
            assert len(expert_units) == 2 * 2, r["kinds"]
            assert all(k == (True, world // 2, 4) for k in expert_units.values()), r["kinds"]
            assert all(k[1] == world for n, k in r["kinds"].items() if not k[0]), r["kinds"]
            torch.testing.assert_close(r["losses"], r["ref_losses"], atol=tol, rtol=tol, msg=f"{rank} {case}")
            torch.testing.assert_close(r["aux"], r["ref_aux"], atol=tol, rtol=tol, msg=f"{rank} {case} aux")
            for name, value in r["params"].items():
                torch.testing.assert_close(value, r["want"][name], atol=tol, rtol=tol, msg=f"{rank} {case} {name}")


# ---------------------------------------------------------------------------- per-rank memory
def _held() -> dict:
    """8 experts, ep=2: the expert and dense elements this rank holds under zero3 (the units'
    fp32 masters and the gathered buffers' capacity) and under DDP (the module's tensors), beside
    ``moe.estimate``'s figures from the all-experts model."""
    from zerotrain.strategies import DDP, ZeroStage3
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.moe.estimate import parameter_split
    from zerotrain.strategies.precision import Precision

    rank, world = init_dist()
    gate = dict(k=2, drop_tokens=False)

    def net(ep: int) -> TrainModule:
        torch.manual_seed(0)
        n = _Net(ep, gate)
        for block in n.blocks:
            block.moe = MoE(HIDDEN, _expert(), num_experts=8, ep_size=ep, gate=GateConfig(**gate))
        return n

    split = parameter_split(net(1), ep_size=2)
    out = {"estimate": {"ddp": split.per_rank(world, False), "zero3": split.per_rank(world, True)},
           "total": (split.dense, split.experts)}
    z = ZeroStage3(process_group_timeout_s=60)
    set_up_like_trainer(z, net(2), detect(world), Precision())
    z.training_step(_batch(0, rank), 0)  # a step: the experts' gathers and reductions run too
    experts = sum(u.master.numel() for u in z.units if u.has_own_group)
    dense = [u.master.numel() for u in z.units if not u.has_own_group]
    out["zero3"] = (sum(dense), experts)
    out["padding"] = len(dense) * world * z.config.partition_alignment  # at most, per unit
    d = DDP(process_group_timeout_s=60)
    model = net(2)
    set_up_like_trainer(d, model, detect(world), Precision())
    held = [p for p in model.parameters()]
    out["ddp"] = (sum(p.numel() for p in held if getattr(p, "allreduce", True)),
                  sum(p.numel() for p in held if getattr(p, "allreduce", True) is False))
    out["placed"] = parameter_split(model).per_rank(world, False)
    from zerotrain.strategies.moe.estimate import estimate_with_experts
    est = estimate_with_experts(split.dense, split.experts, world, 2, "32")
    out["bytes"] = {"zero3": (4 * (sum(dense) + experts), est["zero3"].params),
                    "ddp": (4 * sum(p.numel() for p in held), est["ddp"].params)}
    return out


def test_each_rank_holds_half_the_experts_with_ep2(tmp_path):
    """8 experts, ep=2 on 2 ranks: each rank holds exactly half of the expert parameters, under
    zero3 (measured: its expert units' masters; the expert-data-parallel group is the rank alone,
    so nothing partitions them further) and under DDP, as ``moe.estimate`` says; zero3's dense
    parameters are halved too (over the world); the parameter bytes beside ``zerotrain-estimate
    --expert-params``'s formula (``estimate_with_experts``)."""
    for r in run_ranks("test_moe_zero3:_held", 2, tmp_path, timeout=120):
        dense, experts = r["total"]
        assert experts == 2 * 8 * (HIDDEN * WIDTH + WIDTH + WIDTH * HIDDEN + HIDDEN)
        assert r["zero3"][1] == experts // 2 and r["estimate"]["zero3"] == (dense // 2, experts // 2)
        assert dense / 2 <= r["zero3"][0] <= dense / 2 + r["padding"], (r["zero3"], dense)
        assert r["ddp"] == (dense, experts // 2) == r["estimate"]["ddp"] == r["placed"]
        measured, estimated = r["bytes"]["zero3"]  # zerotrain-estimate's formula, fp32 parameters
        assert estimated <= measured <= estimated + 4 * r["padding"], r["bytes"]
        assert r["bytes"]["ddp"][0] == r["bytes"]["ddp"][1], r["bytes"]


# ---------------------------------------------------------------------------- not yet: clear errors
def _refusals() -> dict:
    from zerotrain.strategies import Offload, ZeroStage3
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision

    rank, world = init_dist()
    gate = dict(k=1, capacity_factor=0.75, min_capacity=1)
    out = {}
    for what, make in (("hpz", lambda: ZeroStage3(hierarchical_partition=True, process_group_timeout_s=60)),
                       ("offload", lambda: Offload(stage=3, optimizer_device="cpu", process_group_timeout_s=60))):
        try:
            set_up_like_trainer(make(), _Net(2, gate), detect(world), Precision())
            out[what] = "accepted"
        except ValueError as e:
            out[what] = str(e)
    z = ZeroStage3(process_group_timeout_s=60)
    set_up_like_trainer(z, _Net(2, gate), detect(world), Precision())
    for what, call in (("checkpoint", z.param_shards), ("full_state_dict", z.full_state_dict),
                       ("load", lambda: z.load_param_shards(None))):
        try:
            call()
            out[what] = "accepted"
        except ValueError as e:
            out[what] = str(e)
    return out


def test_what_zero3_does_not_do_with_experts_yet_is_refused(tmp_path):
    """hpZ, offload and checkpoints of expert units: one clear line each, on every rank, instead
    of a wrong result (a checkpoint would save both ranks' local experts under one name)."""
    for r in run_ranks("test_moe_zero3:_refusals", 2, tmp_path, timeout=120):
        assert "hierarchical_partition=True with expert-parallel units" in r["hpz"], r["hpz"]
        assert "offload with expert-parallel parameters" in r["offload"], r["offload"]
        assert "a checkpoint with expert-parallel units" in r["checkpoint"] and "valid:" in r["checkpoint"]
        assert "full_state_dict() with expert-parallel units" in r["full_state_dict"], r["full_state_dict"]
        # a load read local expert names: every expert-parallel place got experts 0..local-1
        assert "a checkpoint load with expert-parallel units" in r["load"], r["load"]
