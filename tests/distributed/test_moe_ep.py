"""Expert parallelism (strategies/moe/): ``ep_size=2`` on 2 real processes, and ep=2 x 2 expert-data
replicas on 4, equal one process holding every expert (fp32). Each rank routes its own tokens; the
reference runs every rank's tokens through the all-expert layer with that rank's seed and sums the
losses. Then each rank's output, l_aux and exp_counts equal the reference's for its tokens; dense
gradients summed over the world and expert gradients summed over the expert-data-parallel group
equal the reference's (an expert's gradient already holds every rank's tokens, by the all-to-all's
backward). Cases: top-1 and top-2, dropping (the same tokens dropped: capacity is per rank) and
no-drop (capacity = the busiest expert over the group), random token selection, residual.
Tolerance: fp32 eps times the hidden size times the number of summed shards, times the scale."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import init_dist, run_ranks
from zerotrain.strategies import instrument
from zerotrain.strategies.moe import GateConfig, MoE, expert_groups
from zerotrain.trainer.api.module import TrainModule

pytestmark = pytest.mark.timeout(240)

HIDDEN, EXPERTS, TOKENS = 8, 4, (2, 6)
CASES = {
    "top1_rts_drop": dict(k=1, capacity_factor=0.5, min_capacity=1),
    "top1_nodrop": dict(k=1, drop_tokens=False, use_rts=False),
    "top2_drop": dict(k=2, capacity_factor=0.5, min_capacity=1),
    "top2_nodrop_residual": dict(k=2, drop_tokens=False, use_residual=True),
}


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 16), torch.nn.GELU(), torch.nn.Linear(16, HIDDEN))


def _loss(layer, x, w, seed):
    torch.manual_seed(seed)
    out, l_aux, counts = layer(x)
    return (out * w).sum() + l_aux, out.detach(), l_aux.detach(), counts


class _Sink:
    def __init__(self) -> None:
        self.ops = []

    def collective(self, event) -> None:
        self.ops.append(event.op)


def _case(rank: int, world: int, ep: int, kw: dict) -> dict:
    torch.manual_seed(3)
    gate = {key: value for key, value in kw.items() if key != "use_residual"}
    residual = kw.get("use_residual", False)
    full = MoE(HIDDEN, _expert(), num_experts=EXPERTS, gate=GateConfig(**gate), use_residual=residual)
    g = torch.Generator().manual_seed(5)
    full.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in full.state_dict().items()})
    part = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep, gate=GateConfig(**gate), use_residual=residual)
    local = part.num_local_experts
    first = (rank % ep) * local  # my place in my expert-parallel group
    part.load_state_dict(_local_state(full.state_dict(), rank, ep, local))
    gen = torch.Generator().manual_seed(11)
    shards = [(torch.randn(*TOKENS, HIDDEN, generator=gen), torch.randn(*TOKENS, HIDDEN, generator=gen))
              for _ in range(world)]
    want = {}
    for s, (x, w) in enumerate(shards):
        xs = x.clone().requires_grad_(True)
        loss, out, l_aux, counts = _loss(full, xs, w, 100 + s)
        loss.backward()
        if s == rank:
            want.update(out=out, l_aux=l_aux, counts=counts, x_grad=xs.grad)
    for name, p in full.named_parameters():
        want[name] = p.grad
    x, w = shards[rank]
    x = x.clone().requires_grad_(True)
    sink = _Sink()
    instrument.add_sink(sink)
    try:
        loss, out, l_aux, counts = _loss(part, x, w, 100 + rank)
        loss.backward()
    finally:
        instrument.remove_sink(sink)
    got = dict(out=out, l_aux=l_aux, counts=counts, x_grad=x.grad)
    groups = expert_groups(ep)
    for name, p in part.named_parameters():
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad)
            got[name] = p.grad
        else:
            if len(groups.edp_ranks) > 1:
                dist.all_reduce(p.grad, group=groups.edp_group)
            prefix, idx, rest = name.split(".experts.experts.")[0], *name.split(".experts.experts.")[1].split(".", 1)
            got[f"{prefix}.experts.experts.{int(idx) + first}.{rest}"] = p.grad
    return {"got": got, "want": want, "ops": sink.ops, "edp": list(groups.edp_ranks), "ep": list(groups.ep_ranks)}


def _ranks(ep: int) -> dict:
    rank, world = init_dist()
    return {case: _case(rank, world, ep, kw) for case, kw in CASES.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_all_experts_on_one_process(world, tmp_path):
    results = run_ranks("test_moe_ep:_ranks", world, tmp_path, timeout=180, ep=2)
    tol = 8 * torch.finfo(torch.float32).eps * HIDDEN * 16 * world
    for rank, res in enumerate(results):
        for case, r in res.items():
            assert r["ep"] == [rank - rank % 2, rank - rank % 2 + 1] and r["edp"] == list(range(rank % 2, world, 2))
            assert r["ops"].count("all_to_all") == 4, r["ops"]  # dispatch and combine, forward and backward
            got, want = r["got"], r["want"]
            mine = {f".experts.experts.{i}." for i in range((rank % 2) * 2, (rank % 2) * 2 + 2)}  # 4 experts, ep=2
            held = {n for n in want if ".experts.experts." not in n or any(m in n for m in mine)}
            assert got.keys() == held, (case, sorted(got), sorted(held))
            assert torch.equal(got["counts"], want["counts"]), (rank, case)
            for name in got:
                torch.testing.assert_close(got[name], want[name], atol=tol, rtol=tol, msg=f"rank {rank} {case} {name}")


def _broadcast(world_seed: int) -> dict:
    """``deepspeed.initialize``'s weight broadcast with MoE layers of ep=2 and ep=1 built from a
    per-rank seed: dense weights become rank 0's, experts their expert-data-parallel group's first
    rank's (ep=2 on 2 ranks: a group of one, so each keeps its own)."""
    from zerotrain.deepspeed.moe.layer import MoE as DSMoE
    from zerotrain.trainer.compat.deepspeed import _broadcast_weights

    rank, _ = init_dist()
    torch.manual_seed(world_seed + rank)
    model = torch.nn.ModuleDict({"ep2": DSMoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=2),
                                 "ep1": DSMoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=1)})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _broadcast_weights(model, torch.device("cpu"))
    return {"before": before, "after": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_initialize_broadcasts_experts_only_over_their_replicas(tmp_path):
    r0, r1 = run_ranks("test_moe_ep:_broadcast", 2, tmp_path, timeout=120, world_seed=40)
    for name, value in r1["after"].items():
        if name.startswith("ep2.") and ".deepspeed_experts." in name:
            assert torch.equal(value, r1["before"][name]) and not torch.equal(value, r0["before"][name]), name
        else:
            assert torch.equal(value, r0["before"][name]), name


# ---------------------------------------------------------------------------- under the DDP strategy
class _Net(TrainModule):
    def __init__(self, ep: int, drop: bool = True) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        gate = GateConfig(k=1, capacity_factor=0.75, min_capacity=1) if drop else GateConfig(k=1, drop_tokens=False)
        self.moe = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep, gate=gate)

    def training_step(self, batch, idx):
        x, w = batch
        out, l_aux, counts = self.moe(self.inp(x))
        self.aux, self.counts = l_aux.detach(), counts
        return (out * w).mean() + 0.1 * l_aux

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5), None


def _ddp(steps: int, clip: float | None, drop: bool = True) -> dict:
    from zerotrain.strategies import DDP
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision
    from harness import set_up_like_trainer

    rank, world = init_dist()
    torch.manual_seed(0)
    full = _Net(1, drop)
    g = torch.Generator().manual_seed(5)
    full.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in full.state_dict().items()})
    part = _Net(2, drop)
    part.load_state_dict(_local_state(full.state_dict(), rank, 2, part.moe.num_local_experts))
    out = {}
    for ep, net in ((1, full), (2, part)):
        strategy = DDP(process_group_timeout_s=60)
        set_up_like_trainer(strategy, net, detect(world), Precision())
        losses, auxes, counts = [], [], []
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own tokens
            batch = (torch.randn(2, 6, HIDDEN, generator=gen), torch.randn(2, 6, HIDDEN, generator=gen))
            torch.manual_seed(7 + 10 * step + rank)  # the same random token selection in both runs
            loss = strategy.training_step(batch, 0)
            strategy.backward(loss)
            strategy.optimizer_step(clip)
            losses.append(loss.detach())
            auxes.append(net.aux)
            counts.append(net.counts)
        out[ep] = {"losses": losses, "aux": auxes, "counts": counts, "state": {k: v.clone() for k, v in net.state_dict().items()}}
    return out


def _local_state(state: dict, rank: int, ep: int, local: int) -> dict:
    """The all-experts state's entries a rank of expert-parallel size ``ep`` holds, renumbered."""
    first, out = (rank % ep) * local, {}
    for name, value in state.items():
        if ".experts.experts." in name:
            prefix, rest = name.split(".experts.experts.")
            idx, tail = rest.split(".", 1)
            if first <= int(idx) < first + local:
                out[f"{prefix}.experts.experts.{int(idx) - first}.{tail}"] = value
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("clip,drop", [(None, True), (0.05, True), (None, False)])
def test_ddp_reduces_experts_over_their_replicas_only(tmp_path, clip, drop):
    """DDP with ep=2 on 2 ranks trains as DDP with every expert on every rank (which equals one
    process over the global batch, tests/distributed/test_ddp.py): the same losses, aux losses and
    parameters after 3 SGD steps (torch's reducer would have averaged different experts together),
    also when the gradient norm is clipped (the norm then joins every rank's experts), with a
    capacity that drops tokens (the same tokens: the counts per expert agree) and without."""
    results = run_ranks("test_moe_ep:_ddp", 2, tmp_path, timeout=180, steps=3, clip=clip, drop=drop)
    tol = 8 * torch.finfo(torch.float32).eps * HIDDEN * 16 * 2 * 3
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[2]["losses"], r[1]["losses"], atol=tol, rtol=tol)
        torch.testing.assert_close(r[2]["aux"], r[1]["aux"], atol=tol, rtol=tol)
        for got, want in zip(r[2]["counts"], r[1]["counts"]):
            assert torch.equal(got, want), (rank, got, want)
        want = _local_state(r[1]["state"], rank, 2, EXPERTS // 2)
        assert r[2]["state"].keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(r[2]["state"][name], value, atol=tol, rtol=tol, msg=f"rank {rank} {name}")


def _refuses(name: str) -> str:
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision
    from zerotrain.strategies.registry import strategy_from_name
    from harness import set_up_like_trainer

    _, world = init_dist()
    strategy = strategy_from_name(name, process_group_timeout_s=60)
    try:
        set_up_like_trainer(strategy, _Net(2), detect(world), Precision())
    except ValueError as e:
        return str(e)
    return "accepted"


def test_offload_refuses_expert_parallel_models_until_it_reduces_them(tmp_path):
    """ZeRO-2 with its optimizer offloaded (the host stepper) would average different experts'
    gradients over the world: a clear error instead (ZeRO-1/2 on the device partition them over
    their expert-data-parallel group: test_moe_zero12.py)."""
    for message in run_ranks("test_moe_ep:_refuses", 2, tmp_path, timeout=120, name="offload_cpu"):
        assert "is an expert's of ep_size_2" in message and "valid: strategy='ddp', 'zero1' or 'zero2'" in message, \
            message


def _gradless_expert() -> dict:
    from zerotrain.strategies.moe.experts import mark_expert
    from zerotrain.strategies.moe.grads import expert_norm_sq, reduce_expert_grads

    rank, world = init_dist()
    p = torch.nn.Parameter(torch.zeros(3))
    mark_expert(p, "ep_size_2")
    if rank == 1:  # rank 0's expert saw no token this step: no gradient at all
        p.grad = torch.full((3,), 2.0)
    norm_sq = expert_norm_sq([p])  # every rank joins the expert-parallel sum
    reduce_expert_grads([p], world)
    return {"norm_sq": norm_sq.item(), "grad": p.grad.clone()}


def test_an_expert_without_gradient_still_joins_its_groups_collectives(tmp_path):
    """A rank whose expert got no token has no gradient for it; it must still join the norm's and
    the gradients' collectives (skipping them hung its peers), counting zeros."""
    r0, r1 = run_ranks("test_moe_ep:_gradless_expert", 2, tmp_path, timeout=60)
    assert r0["norm_sq"] == r1["norm_sq"] == 12.0
    assert torch.equal(r0["grad"], torch.zeros(3)) and torch.equal(r1["grad"], torch.full((3,), 1.0))
