"""Expert parallelism under ZeRO-1 and ZeRO-2 (strategies/zero/experts.py): ep=2 on 2 real processes,
and ep=2 x 2 expert-data-parallel replicas on 4, train as the plain single-process loop with every
expert local.

The reference, on every rank: one module holding all experts; each step runs every rank's batch
through it with that rank's seed (capacity is per rank's tokens, so the same tokens are dropped),
averages the losses, backward, clips by torch's ``clip_grad_norm_`` when asked, SGD step. The ZeRO
run: the same module with ``ep_size=2`` (this rank's experts only), the optimizer over
``split_params_into_different_moe_groups_for_optimizer``'s groups (dense, then experts), small
buckets (several per group, some spanning parameters), driven as the Trainer drives a strategy.
Compared: every step's loss and aux loss of this rank, and every final parameter (this rank's
experts against the reference's experts of the same global index). SGD, not Adam: a wrong divisor
of the expert gradients (W/ep instead of W) would be scaled away by Adam's normalisation.

Tolerance: fp32 eps times the longest reduction (a gradient sums one term per token of every
rank: TOKENS * world) times the steps; 8.6e-6 on 2 ranks (the issue's 1e-5), 1.7e-5 on 4. Seen:
1.2e-7 (one ulp) everywhere."""
from __future__ import annotations

import pytest
import torch

from harness import init_dist, run_ranks, set_up_like_trainer
from test_moe_ep import HIDDEN, _expert, _local_state
from zerotrain.strategies.moe import GateConfig, MoE
from zerotrain.strategies.moe.gate import capacity_of
from zerotrain.trainer.api.module import TrainModule

pytestmark = pytest.mark.timeout(400)

STEPS, EXPERTS, TOKENS = 3, 6, 12  # 3 local experts: the EDP partition boundary cuts one
MODES = {"drop": dict(k=1, capacity_factor=0.75, min_capacity=1),
         "nodrop": dict(k=2, drop_tokens=False)}


class _Net(TrainModule):
    def __init__(self, ep: int, gate: dict) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep, gate=GateConfig(**gate))
        self.l_aux: list[torch.Tensor] = []
        self.most = 0  # the most tokens routed to one expert of one rank (before dropping)

    def loss(self, batch):
        x, w = batch
        out, l_aux, counts = self.moe(self.inp(x))
        self.l_aux.append(l_aux.detach())
        self.most = max(self.most, int(counts.max()))
        return (out * w).mean() + 0.1 * l_aux

    def training_step(self, batch, idx):
        return self.loss(batch)

    def configure_optimizers(self):
        from zerotrain.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(self.parameters()),
                                                                       "name": "parameters"})
        return torch.optim.SGD(groups, lr=0.5, momentum=0.5), None


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own tokens
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=gen), torch.randn(2, TOKENS // 2, HIDDEN, generator=gen)


def _seed(step: int, rank: int) -> None:
    torch.manual_seed(7 + 10 * step + rank)  # the same random draws (RTS, 2nd expert) in both runs


def _reference(full: _Net, world: int, clip: float | None) -> dict:
    opt, _ = full.configure_optimizers()
    losses, l_aux, norms = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = []
        for r in range(world):
            _seed(step, r)
            per_rank.append(full.loss(_batch(step, r)))
        l_aux.append(full.l_aux[-world:])
        loss = torch.stack(per_rank).mean()
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(full.parameters(), clip)))
        opt.step()
        losses.append(torch.stack(per_rank).detach())
    return {"losses": losses, "l_aux": l_aux, "norms": norms, "most": full.most, "state": {k: v.clone() for k, v in full.state_dict().items()}}


def _zero(stage: int, mode: str, clip: float | None) -> dict:
    from zerotrain.strategies import ZeroStage1, ZeroStage2
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision

    rank, world = init_dist()
    gate = MODES[mode]
    torch.manual_seed(0)
    full = _Net(1, gate)
    g = torch.Generator().manual_seed(5)
    full.load_state_dict({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in full.state_dict().items()})
    part = _Net(2, gate)
    part.load_state_dict(_local_state(full.state_dict(), rank, 2, part.moe.num_local_experts))
    want = _reference(full, world, clip)
    strategy = {1: ZeroStage1, 2: ZeroStage2}[stage](process_group_timeout_s=60, reduce_bucket_size=100)
    set_up_like_trainer(strategy, part, detect(world), Precision())
    losses = []
    for step in range(STEPS):
        _seed(step, rank)
        loss = strategy.training_step(_batch(step, rank), 0)
        strategy.backward(loss)
        strategy.optimizer_step(clip)
        losses.append(loss.detach())
    sizes = [(fg.layout.world_size, fg.rank) for fg in strategy.flat_groups]
    experts = strategy.flat_groups[1].layout
    cut = sum(len(experts.pieces_of(i)) > 1 for i in range(len(experts.spans)))
    return {"want": want, "losses": losses, "l_aux": part.l_aux, "sizes": sizes, "cut": cut,
            "state": {k: v.clone() for k, v in part.state_dict().items()}}


def _check(results: list, world: int, mode: str, clip: float | None) -> None:
    tol = torch.finfo(torch.float32).eps * TOKENS * world * STEPS
    for rank, r in enumerate(results):
        want = r["want"]
        # the case is what it says: tokens dropped, the norm clipped, an expert cut by the EDP partition
        if mode == "drop":
            assert want["most"] > capacity_of(TOKENS, EXPERTS, MODES[mode]["capacity_factor"], 1), want["most"]
        assert all(n > clip for n in want["norms"]) if clip is not None else not want["norms"], want["norms"]
        assert (r["cut"] > 0) == (world > 2), r["cut"]
        # the dense group partitioned over the world, the experts' over their EDP group of world / 2
        assert r["sizes"] == [(world, rank), (world // 2, rank // 2)], r["sizes"]
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack([s[rank] for s in want["losses"]]),
                                   atol=tol, rtol=tol)
        torch.testing.assert_close(torch.stack(r["l_aux"]), torch.stack([s[rank] for s in want["l_aux"]]),
                                   atol=tol, rtol=tol)
        expected = _local_state(want["state"], rank, 2, EXPERTS // 2)
        assert r["state"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(r["state"][name], value, atol=tol, rtol=tol, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode,clip", [("drop", None), ("nodrop", None), ("drop", 0.25)])
def test_ep2_under_zero_equals_one_process_with_every_expert(tmp_path, stage, mode, clip):
    """ep=2 on 2 ranks (EDP groups of one: each rank steps its experts whole), with a capacity
    that drops tokens and without, and with the gradient norm clipped (the norm joins both
    ranks' experts once each)."""
    results = run_ranks("test_moe_zero12:_zero", 2, tmp_path, timeout=300, stage=stage, mode=mode, clip=clip)
    _check(results, 2, mode, clip)


@pytest.mark.parametrize("stage", [1, 2])
def test_ep2_by_edp2_under_zero_equals_one_process_with_every_expert(tmp_path, stage):
    """ep=2 x edp=2 on 4 ranks: each expert group's flat buffer is partitioned over its 2
    replicas (parameters cut by the partition boundary: the clip norm assembles them over the
    EDP group), dense over the 4; dropping capacity, clipped."""
    results = run_ranks("test_moe_zero12:_zero", 4, tmp_path, timeout=360, stage=stage, mode="drop", clip=0.25)
    _check(results, 4, "drop", 0.25)


# ---------------------------------------------------------------------------- checkpoints
def _setup(stage: int, ep: int, world: int):
    from zerotrain.strategies import ZeroStage1, ZeroStage2
    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.precision import Precision

    torch.manual_seed(0)
    net = _Net(ep, MODES["drop"])
    strategy = {1: ZeroStage1, 2: ZeroStage2}[stage](process_group_timeout_s=60, reduce_bucket_size=100)
    set_up_like_trainer(strategy, net, detect(world), Precision())
    return strategy, net


def _save(path: str) -> dict:
    """ZeRO-2, ep=2 on 2 ranks: two steps from distinct experts, then a checkpoint."""
    from harness import save_checkpoint

    rank, world = init_dist()
    strategy, net = _setup(2, 2, world)
    g = torch.Generator().manual_seed(5)
    full = {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in _Net(1, MODES["drop"]).state_dict().items()}
    _load_working(strategy, net, _local_state(full, rank, 2, EXPERTS // 2))
    for step in range(2):
        _seed(step, rank)
        strategy.backward(strategy.training_step(_batch(step, rank), 0))
        strategy.optimizer_step(None)
    save_checkpoint(strategy, path)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    _step(strategy, 2, rank)
    return {"saved": saved, "next": {k: v.clone() for k, v in net.state_dict().items()}}


def _step(strategy, step: int, rank: int) -> None:
    _seed(step, rank)
    strategy.backward(strategy.training_step(_batch(step, rank), 0))
    strategy.optimizer_step(None)


def _load_working(strategy, net, state: dict) -> None:
    """Set the weights of a set-up ZeRO-1/2 module: its working views and this rank's masters."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(state[name])
        for fg, master in zip(strategy.flat_groups, strategy.sharded.masters):
            master.copy_(fg.partition(fg.rank))


def _load(path: str, ep: int, stage: int, step: bool = False) -> dict:
    from harness import load_checkpoint

    rank, world = init_dist()
    strategy, net = _setup(stage, ep, world)
    load_checkpoint(strategy, path)
    if step:  # the step after the save, from the loaded weights and momentum
        _step(strategy, 2, rank)
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_experts_are_saved_under_their_global_index_and_reshard_across_ep_size(tmp_path):
    """ZeRO-2 ep=2 on 2 ranks saves each expert once, under its global index (each rank's local
    expert 0 is another expert); ZeRO-1 ep=1 on one process loads all six experts, ZeRO-1 ep=2 x
    edp=2 on 4 ranks its place's three: every weight equal to the saving rank's; ZeRO-1 ep=2 on the
    same 2 ranks then takes the step the saving run took after the save, bit for bit."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks("test_moe_zero12:_save", 2, tmp_path / "save", timeout=300, path=path)
    everything = {}
    for rank, state in enumerate(saved):
        for name, value in state["saved"].items():
            if ".experts.experts." in name:
                prefix, rest = name.split(".experts.experts.")
                idx, tail = rest.split(".", 1)
                name = f"{prefix}.experts.experts.{int(idx) + rank * (EXPERTS // 2)}.{tail}"
            everything.setdefault(name, value)
    (one,) = run_ranks("test_moe_zero12:_load", 1, tmp_path / "one", timeout=300, path=path, ep=1, stage=1)
    assert one.keys() == everything.keys()
    for name, value in everything.items():
        assert torch.equal(one[name], value), name
    four = run_ranks("test_moe_zero12:_load", 4, tmp_path / "four", timeout=300, path=path, ep=2, stage=1)
    for rank, state in enumerate(four):
        want = _local_state(everything, rank, 2, EXPERTS // 2)
        assert state.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(state[name], value), (rank, name)
    # the same 2 ranks under ZeRO-1: the next step equals the saving run's (SGD momentum restored)
    again = run_ranks("test_moe_zero12:_load", 2, tmp_path / "again", timeout=300, path=path, ep=2, stage=1,
                      step=True)
    for rank, state in enumerate(again):
        for name, value in saved[rank]["next"].items():
            torch.testing.assert_close(state[name], value, atol=0, rtol=0, msg=f"rank {rank} {name}")
