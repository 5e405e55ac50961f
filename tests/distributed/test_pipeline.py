"""The pipeline strategy on real processes (gloo) against a plain single-process loop.

Each rank drives the Strategy API in the Trainer's order (connect, setup_environment,
configure_model, setup_module, setup_optimizer, then run_schedule / optimizer_step),
and also runs the reference: an ``nn.Sequential`` of the same layers with the same initial weights,
trained on the concatenation of every replica's global batch with the loss averaged the same way
(mean over rows; micro-batches are equal-sized, so the mean of micro-batch means is that mean).
The optimizer is built on ``strategy.parameters_for_optimizer()``: this stage's parameters.

Several cases share one spawn: world 2 runs the 2-stage cases, world 4 the 4-stage and the
2-stage x 2-replica cases.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import load_checkpoint, run_ranks, save_checkpoint
from tolerance import backward_per_rank, mean_rtol, peer_bound, rel_err

STEPS = 10
VOCAB, DIM, SEQ = 13, 8, 6


# ---------------------------------------------------------------------------- models
def _lm_head(emb: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ emb.weight.t()


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm_reference() -> nn.Sequential:
    ref = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM), nn.GELU(),
                        nn.Linear(DIM, DIM), nn.Linear(DIM, VOCAB, bias=False))
    ref[6].weight = ref[0].weight  # the LM head is the embedding
    return ref


def _lm_layers():
    from zerotrain.strategies.pipeline import LayerSpec, TiedLayerSpec
    return [TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM), LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.GELU),
            LayerSpec(nn.Linear, DIM, DIM), LayerSpec(nn.GELU), LayerSpec(nn.Linear, DIM, DIM),
            TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_lm_head)]


def _deep_reference() -> nn.Sequential:
    """An LM deep enough for 4 stages x 2 chunks, its head sharing the embedding's weight."""
    hidden = [m for _ in range(4) for m in (nn.Linear(DIM, DIM), nn.GELU())]
    ref = nn.Sequential(nn.Embedding(VOCAB, DIM), *hidden, nn.Linear(DIM, VOCAB, bias=False))
    ref[-1].weight = ref[0].weight
    return ref


def _mlp_reference() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


class _WithMask(nn.Module):
    """Starts a (hidden, mask) tuple: the bool mask needs no gradient and passes through stages."""

    def forward(self, x):
        return x, x[..., 0] > 0


class _MaskedLinear(nn.Linear):
    def forward(self, hm):
        h, mask = hm
        return torch.tanh(super().forward(h)) * mask.unsqueeze(-1), mask


class _DropMask(nn.Module):
    def forward(self, hm):
        return hm[0]


def _tuple_reference() -> nn.Sequential:
    return nn.Sequential(_WithMask(), _MaskedLinear(DIM, DIM), _MaskedLinear(DIM, DIM), _MaskedLinear(DIM, 4),
                         _DropMask())


def _batch(kind: str, step: int, replica: int, rows: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    if kind in ("lm", "deep"):
        return torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, 4, generator=g)


# ---------------------------------------------------------------------------- one case on one rank
class _Hooks:
    """What the Trainer lends run_schedule, without callbacks: the pipeline calls only these."""
    accumulation = 1

    def loss_of(self, out):
        return out


def _same(a: dict, b: dict) -> bool:
    """Nested dicts of tensors (and numbers) with the same keys and equal values."""
    if sorted(a) != sorted(b):
        return False
    return all(_same(v, b[k]) if isinstance(v, dict) else torch.equal(torch.as_tensor(v), torch.as_tensor(b[k]))
               for k, v in a.items())


def _ratio(got: dict, ref_state: dict, peer_state: dict, prefix: str = "") -> float:
    """The worst tensor's relative error against the plain loop over its bound: no worse than the
    peer (the plain loop summed as the pipeline's replicas and micro-batches sum), PEER_FACTOR x
    the peer's error + 4 ulps (``tolerance.peer_bound``); at most 1 passes."""
    return max(rel_err(got[prefix + k], v) / peer_bound(rel_err(peer_state[k], v)) for k, v in ref_state.items()
               if prefix + k in got)


def _val_ok(r: dict, key: str) -> bool:
    """An evaluation loss of the trained weights: no worse than the peer's, + 2 mean_rtol(n) for
    two orders of one n-term mean (``r["terms"]``: the global batch's loss terms)."""
    want = r[f"ref_{key}"]
    bound = peer_bound(abs(r[f"peer_{key}"] - want) / want, floor=2 * mean_rtol(r["terms"]))
    return abs(r[key] - want) <= bound * want


def _run_case(case: dict, ck_name: str) -> dict:
    import torch.distributed as dist

    from zerotrain.strategies.environment import detect
    from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy
    from zerotrain.strategies.precision import precision_from_name
    from zerotrain.trainer.api.module import TrainModule

    kind, stages, m, rows = case["model"], case["stages"], case["micro_batches"], case["rows"]
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    ref = {"lm": _lm_reference, "mlp": _mlp_reference, "tuple": _tuple_reference, "deep": _deep_reference}[kind]()
    peer = copy.deepcopy(ref)  # the plain loop summed as the replicas and micro-batches sum
    loss_fn = _lm_loss if kind in ("lm", "deep") else F.mse_loss

    class Model(TrainModule):
        def __init__(self):
            super().__init__()
            if kind == "lm":  # specs: each stage builds only its layers
                self.pipe = PipelineModule(_lm_layers(), stages, loss_fn=loss_fn)
            else:  # an existing Sequential (shared weights would become ties)
                self.pipe = PipelineModule.from_sequential(copy.deepcopy(ref), stages, loss_fn=loss_fn,
                                                           partition_method=case.get("partition", "parameters"))

    strategy = PipelineStrategy(stages=stages, schedule=case["schedule"], micro_batches=m,
                                activation_checkpointing=case.get("ckpt", False), process_group_timeout_s=60,
                                zero_stage=case.get("zero", 0), virtual_stages=case.get("virtual", 1))
    strategy.connect(detect(devices=world), torch.device("cpu"), precision_from_name(case.get("precision", "32")))
    strategy.setup_environment()
    model = Model()
    strategy.configure_model(model)
    pipe, stage, replica = model.pipe, strategy.stage, strategy.data_parallel_rank
    state = pipe.stage_state_dict(ref.state_dict())
    with torch.no_grad():
        for tie in pipe.ties:  # only the lowest owning stage starts right: set-up must broadcast it
            if stage != pipe.tie_owner_stages(tie)[0]:
                for i, name in tie.members:
                    state.pop(f"{i}.{name}", None)
        if replica > 0:  # other replicas start wrong: set-up must broadcast replica 0
            state = {k: torch.randn_like(v) for k, v in state.items()}
        pipe.load_state_dict(state, strict=False)
    strategy.setup_module(model)

    def make_opt(params):
        if case["optimizer"] == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    strategy.setup_optimizer(make_opt(strategy.parameters_for_optimizer()))
    ref_opt, peer_opt = make_opt(ref.parameters()), make_opt(peer.parameters())
    clip, replicas = case.get("clip"), strategy.data_parallel_world_size
    losses, ref_losses, peer_losses, clipped = [], [], [], 0
    for step in range(STEPS):
        loss = strategy.run_schedule(_batch(kind, step, replica, rows), step, _Hooks())
        strategy.optimizer_step(clip)
        losses.append(float(loss))
        xs, ys = zip(*[_batch(kind, step, r, rows) for r in range(replicas)])
        ref_loss = loss_fn(ref(torch.cat(xs)), torch.cat(ys))
        ref_loss.backward()
        if clip:
            clipped += int(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))
        with torch.no_grad():
            peer_losses.append(float(loss_fn(peer(torch.cat(xs)), torch.cat(ys))))
        backward_per_rank(peer.parameters(), [list(zip(x.chunk(m), y.chunk(m))) for x, y in zip(xs, ys)],
                          lambda b: loss_fn(peer(b[0]), b[1]))
        if clip:
            torch.nn.utils.clip_grad_norm_(peer.parameters(), clip)
        peer_opt.step()
        peer_opt.zero_grad()

    ref_state, peer_state = ref.state_dict(), peer.state_dict()
    mine = {k[len("pipe."):]: v for k, v in model.state_dict().items()}
    out = {"rank": dist.get_rank(), "stage": stage, "replica": replica, "ratio": _ratio(mine, ref_state, peer_state),
           "losses": losses, "ref_losses": ref_losses, "peer_losses": peer_losses,
           "terms": replicas * rows * (SEQ if kind in ("lm", "deep") else 4),
           "peak": strategy.live_activation_peak, "clipped": clipped,
           "keys": sorted(mine), "writes_shard": strategy.writes_shard()}
    shards, numel = strategy.param_shards(), {n: p.numel() for n, p in model.named_parameters()}
    out["shard_ranges"] = {n: (sh.start, sh.end) for n, sh in shards.items()}
    out["stage_numel"] = sum(numel.values())
    out["state_numel"] = sum(v.numel() for st in strategy.optimizer.state.values() for k, v in st.items()
                             if k == "exp_avg")
    out["shard_names"] = sorted(shards)
    out["shards_whole"] = all((sh.start, sh.end) == (0, numel[n]) for n, sh in shards.items())
    out["shard_kinds"] = sorted({k for sh in shards.values() for k in sh.tensors})
    out["shards_have_optimizer_state"] = all(len(sh.tensors) > 1 for sh in shards.values())
    full = strategy.full_state_dict()
    if dist.get_rank() == 0:
        out["full_keys"] = sorted(full)
        out["full_ratio"] = _ratio(full, ref_state, peer_state, "pipe.")
    if case.get("validate"):
        x, y = _batch(kind, 99, replica, rows)
        out["val"] = float(strategy.validation_step((x, y), 0))
        xs, ys = zip(*[_batch(kind, 99, r, rows) for r in range(replicas)])
        with torch.no_grad():
            out["ref_val"] = float(loss_fn(ref(torch.cat(xs)), torch.cat(ys)))
            out["peer_val"] = float(loss_fn(peer(torch.cat(xs)), torch.cat(ys)))
        # a short last batch: micro_batches does not divide its rows, so its parts differ in size
        x, y = _batch(kind, 98, replica, rows - 3)
        out["val_short"] = float(strategy.validation_step((x, y), 0))
        xs, ys = zip(*[_batch(kind, 98, r, rows - 3) for r in range(replicas)])
        with torch.no_grad():
            out["ref_val_short"] = float(loss_fn(ref(torch.cat(xs)), torch.cat(ys)))
            out["peer_val_short"] = float(loss_fn(peer(torch.cat(xs)), torch.cat(ys)))
    # a checkpoint round trip through the Trainer's format: every rank (replicas > 0 too, which
    # write nothing) gets its stage's weights and optimizer state back from the files
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(strategy.optimizer.state_dict()["state"])
    ck = save_checkpoint(strategy, Path.cwd() / ck_name)  # the spawn's shared tmp_path
    if case.get("consolidate") and dist.get_rank() == 0:
        out.update(_consolidated(ck, ref_state, peer_state, ck_name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    strategy.optimizer.state.clear()
    load_checkpoint(strategy, ck)
    out["restored"] = (_same(model.state_dict(), params)
                       and _same(strategy.optimizer.state_dict()["state"], opt_state))
    strategy.teardown()
    return out


def _consolidated(ck: Path, ref_state: dict, peer_state: dict, ck_name: str) -> dict:
    """The checkpoint as one plain state dict (``zerotrain-consolidate``): the plain model's keys,
    the tied head under both its names, its values the reference's. That is what any strategy
    reshards from, so it shows a checkpoint written under ZeRO-1 or virtual stages is the
    strategy-neutral layout."""
    from zerotrain.trainer.checkpoint.consolidate import consolidate

    full = torch.load(consolidate(ck, Path.cwd() / f"{ck_name}.pt"), weights_only=True)
    return {"consolidated_keys": sorted(full), "consolidated_ratio": _ratio(full, ref_state, peer_state, "pipe.")}


def _run_trainer_case(case: dict) -> dict:
    """The real Trainer with strategy="pipeline" on a TrainModule holding a PipelineModule made
    from an nn.Sequential whose head shares the embedding's weight (found and tied by
    from_sequential); its DistributedSampler must give both stages of a replica the same data."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from zerotrain.strategies.pipeline import PipelineModule, PipelineStrategy
    from zerotrain.trainer import Trainer
    from zerotrain.trainer.api.module import TrainModule

    stages, accumulate, rows, steps = case["stages"], case["accumulate"], case["rows"], case["steps"]
    world = int(os.environ["WORLD_SIZE"])
    replicas = world // stages
    torch.manual_seed(0)
    ref = _lm_reference()
    g = torch.Generator().manual_seed(5)
    n = replicas * rows * accumulate * steps
    data = TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))

    class PipeLM(TrainModule):
        def __init__(self):
            super().__init__()
            self.pipe = PipelineModule.from_sequential(copy.deepcopy(ref), stages, loss_fn=_lm_loss)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)  # sees the gradient's scale

    model = PipeLM()
    strategy = PipelineStrategy(stages=stages, micro_batches=case["micro_batches"], process_group_timeout_s=60)
    trainer = Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                      accumulate_grad_batches=accumulate, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, DataLoader(data, batch_size=rows, shuffle=False))

    # the plain loop: each accumulation micro-step sees every replica's batch at once; on several
    # replicas the training DistributedSampler shuffles (seed 0, epoch 0) though the loader does not, as Lightning's
    order = [list(DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=replicas > 1)) for r in range(replicas)]
    peer, m = copy.deepcopy(ref), case["micro_batches"]  # peer: summed as replicas, micro-steps, micro-batches sum
    opt, peer_opt = (torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9) for net in (ref, peer))
    for step in range(steps):
        mine_of = [[] for _ in range(replicas)]
        for j in range(accumulate):
            b = step * accumulate + j
            idx = torch.tensor([i for r in range(replicas) for i in order[r][b * rows:(b + 1) * rows]])
            (_lm_loss(ref(data.tensors[0][idx]), data.tensors[1][idx]) / accumulate).backward()
            for r in range(replicas):
                part = torch.tensor(order[r][b * rows:(b + 1) * rows])
                mine_of[r] += zip(data.tensors[0][part].chunk(m), data.tensors[1][part].chunk(m))
        backward_per_rank(peer.parameters(), mine_of, lambda b: _lm_loss(peer(b[0]), b[1]))
        for o in (opt, peer_opt):
            o.step()
            o.zero_grad()
    mine = {k[len("pipe."):]: v for k, v in model.state_dict().items()}
    loss = trainer.callback_metrics.get("train_loss")  # a tensor, as Lightning's: compared as a number
    return {"rank": dist.get_rank(), "ratio": _ratio(mine, ref.state_dict(), peer.state_dict()), "losses": [],
            "ref_losses": [], "peer_losses": [], "terms": 1, "steps": trainer.global_step,
            "train_loss": None if loss is None else float(loss), "ties": [t.key for t in model.pipe.ties]}


def run_cases(cases: list) -> list:
    return [_run_trainer_case(c) if c.get("trainer") else _run_case(c, f"ck{i}") for i, c in enumerate(cases)]


# ---------------------------------------------------------------------------- checks
def _check_equivalent(results: list[dict]) -> None:
    for r in results:
        # tolerance: no worse than the plain loop summed as the replicas and micro-batches sum (PEER_FACTOR x + 4 ulps)
        assert r["ratio"] <= 1, f"rank {r['rank']}: parameters off the plain loop by {r['ratio']:.2f} x their bound"
        if r["losses"]:  # tolerance: as the parameters, + 2 mean_rtol(n) for the first step's two orders of one mean
            err, peer = (rel_err(torch.tensor(r[k]), torch.tensor(r["ref_losses"])) for k in ("losses", "peer_losses"))
            assert err <= peer_bound(peer, floor=2 * mean_rtol(r["terms"])), f"rank {r['rank']}: losses off by {err:.2e}"
    assert len({tuple(r["losses"]) for r in results}) == 1, "ranks returned different losses"


_REF_KEYS = {
    "lm": sorted(_lm_reference().state_dict()),
    "mlp": sorted(_mlp_reference().state_dict()),
}


def test_two_stages_match_a_plain_loop(tmp_path):
    cases = [
        dict(model="mlp", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="sgd"),
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5,
             validate=True),
        dict(model="lm", stages=2, schedule="gpipe", micro_batches=4, rows=8, optimizer="adamw", clip=0.5,
             ckpt=True),
        dict(model="tuple", stages=2, schedule="1f1b", micro_batches=2, rows=6, optimizer="sgd",
             partition="uniform"),
        # smoke: reduced-precision activations cross the boundary; fp16 scales the loss
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", precision="bf16-mixed"),
        dict(model="lm", stages=2, schedule="gpipe", micro_batches=4, rows=8, optimizer="adamw", precision="16-mixed"),
        # interleaved 1F1B: 2 stages x 2 chunks round the ring, the tie between chunks 0 and 3
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, virtual=2,
             validate=True, consolidate=True),
        # zero-bubble H1: the linear layers' weight gradients deferred, the tied head's too
        dict(model="lm", stages=2, schedule="zb_h1", micro_batches=4, rows=8, optimizer="adamw", clip=0.5,
             validate=True),
        dict(model="lm", stages=2, schedule="zb_h1", micro_batches=4, rows=8, optimizer="adamw",
             precision="bf16-mixed"),
    ]
    out = run_ranks("test_pipeline:run_cases", 2, tmp_path, timeout=100, cases=cases)
    mlp, lm, lm_gpipe, tup, bf16, fp16, inter, zb, zb_bf16 = [[ranks[i] for ranks in out] for i in range(len(cases))]
    for results in (mlp, lm, lm_gpipe, tup, inter, zb):
        _check_equivalent(results)
    assert zb[0]["clipped"] > 0 and [r["peak"] for r in zb] == [2, 1]  # 1F1B's live activations
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert all(r["restored"] for r in zb) and _val_ok(zb[0], "val")
    for a, b in zip(zb_bf16[0]["losses"], bf16[0]["losses"]):  # the same bf16 training as 1F1B's
        # tolerance: not an equivalence (bf16/fp16 training against fp32): a sanity bound, a few x 2^-8
        assert abs(a - b) <= 1e-2 * b, (a, b)
    assert inter[0]["clipped"] > 0 and [r["peak"] for r in inter] == [5, 3]  # chunk activations (simulator's)
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert all(r["restored"] for r in inter) and inter[0]["full_ratio"] <= 1
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert _val_ok(inter[0], "val")
    # a short evaluation batch (5 rows in 4 unequal parts) round the ring of chunks
    assert inter[0]["val_short"] == inter[1]["val_short"]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert _val_ok(inter[0], "val_short")
    # the tie between chunks 0 and 3 saved once, by stage 0; the checkpoint consolidates to the plain model
    assert "pipe.0.weight" in inter[0]["shard_names"] and "pipe.0.weight" not in inter[1]["shard_names"]
    assert inter[0]["consolidated_keys"] == ["pipe." + k for k in _REF_KEYS["lm"]]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert inter[0]["consolidated_ratio"] <= 1
    for results in (bf16, fp16):  # same training, to reduced-precision accuracy
        for a, b in zip(results[0]["losses"], results[0]["ref_losses"]):
            # tolerance: not an equivalence (bf16/fp16 training against fp32): a sanity bound, a few x 2^-8
            assert abs(a - b) <= 0.03 * b, (a, b)
    # clipping was active, and the tie spans both stages: each holds its own copy under its name
    assert lm[0]["clipped"] > 0
    assert lm[0]["keys"] + lm[1]["keys"] == sorted(lm[0]["keys"] + lm[1]["keys"])
    assert set(lm[0]["keys"]) | set(lm[1]["keys"]) == set(_REF_KEYS["lm"])
    assert "0.weight" in lm[0]["keys"] and "6.weight" in lm[1]["keys"]
    # checkpoints: each stage's layers under their original names, whole, with their optimizer
    # state, written by both ranks, the tied head (6.weight, the embedding's Parameter in the plain
    # Sequential) once, by stage 0, as 0.weight; a round trip restores every case on every rank
    for r in lm:
        assert r["shard_names"] == ["pipe." + k for k in r["keys"] if k != "6.weight"] and r["shards_whole"]
        assert r["shard_kinds"] == ["exp_avg", "exp_avg_sq", "param"] and r["shards_have_optimizer_state"]
        assert r["writes_shard"]
    assert all(r["restored"] for results in (mlp, lm, lm_gpipe, tup, bf16, fp16) for r in results)
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert lm[0]["full_keys"] == ["pipe." + k for k in _REF_KEYS["lm"]] and lm[0]["full_ratio"] <= 1
    assert mlp[0]["full_keys"] == ["pipe." + k for k in _REF_KEYS["mlp"]]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert lm[0]["val"] == lm[1]["val"] and _val_ok(lm[0], "val")
    assert lm[0]["val_short"] == lm[1]["val_short"]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert _val_ok(lm[0], "val_short")
    # live activations: 1F1B holds at most (stages - stage) micro-batches, GPipe all of them
    assert [r["peak"] for r in lm] == [2, 1] and [r["peak"] for r in lm_gpipe] == [4, 4]


@pytest.mark.slow
def test_four_stages_two_by_two_and_the_trainer_match_a_plain_loop(tmp_path):
    cases = [
        dict(model="lm", stages=4, schedule="1f1b", micro_batches=8, rows=8, optimizer="adamw", clip=0.5),
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5,
             validate=True),
        dict(trainer=True, stages=2, micro_batches=2, rows=4, accumulate=2, steps=3),
        dict(model="lm", stages=4, schedule="zb_h1", micro_batches=8, rows=8, optimizer="adamw", clip=0.5),
    ]
    out = run_ranks("test_pipeline:run_cases", 4, tmp_path, timeout=110, cases=cases)
    four, grid, fit, four_zb = [[ranks[i] for ranks in out] for i in range(len(cases))]
    _check_equivalent(four)
    _check_equivalent(four_zb)
    assert [r["peak"] for r in four_zb] == [4, 3, 2, 1]
    _check_equivalent(grid)
    # the Trainer (2 stages x 2 replicas, accumulate_grad_batches=2) = the plain loop
    _check_equivalent(fit)
    assert all(r["steps"] == 3 and r["ties"] == ["shared:0.weight"] for r in fit)
    assert len({r["train_loss"] for r in fit}) == 1 and fit[0]["train_loss"] is not None
    assert [r["peak"] for r in four] == [4, 3, 2, 1] and max(r["peak"] for r in four) <= 4
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert four[0]["full_ratio"] <= 1 and grid[0]["full_ratio"] <= 1
    # 2 stages x 2 replicas: replica r is ranks 2r, 2r+1; replica 0 writes, replica 1 reads its files
    assert [(r["stage"], r["replica"]) for r in grid] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r["writes_shard"] for r in grid] == [True, True, False, False]
    assert [bool(r["shard_names"]) for r in grid] == [True, True, False, False]
    assert all(grid[r]["shard_names"] == ["pipe." + k for k in grid[r + 2]["keys"] if k != "6.weight"]
               for r in (0, 1))  # the tied head is saved once, as the embedding (0.weight), by stage 0
    assert all(r["restored"] for results in (four, grid) for r in results)
    assert grid[0]["full_keys"] == ["pipe." + k for k in _REF_KEYS["lm"]]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert len({r["val"] for r in grid}) == 1 and _val_ok(grid[0], "val")
    assert len({r["val_short"] for r in grid}) == 1
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert _val_ok(grid[0], "val_short")


@pytest.mark.slow
def test_zero1_two_stages_by_two_replicas_match_a_plain_loop(tmp_path):
    """Pipeline x ZeRO-1: each stage's masters and Adam state split over its two replicas, the
    global norm over every stage and replica, the tied embedding/head across the stages."""
    cases = [
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, zero=1,
             validate=True, consolidate=True),
        # smoke: bf16 working parameters with fp32 masters; fp16 scales the loss and unscales slices
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, zero=1,
             precision="bf16-mixed"),
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, zero=1,
             precision="16-mixed"),
        # interleaved on 4 stages x 2 chunks, and interleaved with ZeRO-1 on 2 stages x 2 replicas
        dict(model="deep", stages=4, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, virtual=2),
        dict(model="lm", stages=2, schedule="1f1b", micro_batches=4, rows=8, optimizer="adamw", clip=0.5, zero=1,
             virtual=2),
    ]
    out = run_ranks("test_pipeline:run_cases", 4, tmp_path, timeout=110, cases=cases)
    zero, bf16, fp16, inter4, inter_zero = [[ranks[i] for ranks in out] for i in range(len(cases))]
    for results in (zero, inter4, inter_zero):
        _check_equivalent(results)
    assert [r["peak"] for r in inter4] == [8, 8, 7, 5] and inter4[0]["clipped"] > 0
    assert all(r["restored"] for r in inter4 + inter_zero)
    assert zero[0]["clipped"] > 0
    for results in (bf16, fp16):  # same training, to reduced-precision accuracy
        for r in results:
            for a, b in zip(r["losses"], r["ref_losses"]):
                # tolerance: not an equivalence (bf16/fp16 training against fp32): a sanity bound, a few x 2^-8
                assert abs(a - b) <= 0.03 * b, (a, b)
    # each replica holds half of its stage's optimizer state (padded to an even split)
    for r in zero:
        assert r["state_numel"] == (r["stage_numel"] + 1) // 2, r
    # every rank writes its partition's pieces; the two replicas' ranges tile each parameter
    assert all(r["writes_shard"] for r in zero)
    for stage in (0, 1):
        a, b = zero[stage]["shard_ranges"], zero[stage + 2]["shard_ranges"]
        for name in set(a) | set(b):
            pieces = sorted(x for x in (a.get(name), b.get(name)) if x)
            assert pieces[0][0] == 0 and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:])), (name, pieces)
    assert all(r["restored"] for results in (zero, bf16, fp16) for r in results)
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert zero[0]["full_ratio"] <= 1
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert len({r["val"] for r in zero}) == 1 and _val_ok(zero[0], "val")
    assert len({r["val_short"] for r in zero}) == 1
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert _val_ok(zero[0], "val_short")
    # the tied head saved once, as the embedding (0.weight), by stage 0's two replicas; the
    # partitioned checkpoint consolidates to the plain model's names and values
    assert all("pipe.6.weight" not in r["shard_names"] for r in zero)
    assert not any("pipe.0.weight" in zero[r]["shard_names"] for r in (1, 3))
    assert any("pipe.0.weight" in zero[r]["shard_names"] for r in (0, 2))
    assert zero[0]["consolidated_keys"] == ["pipe." + k for k in _REF_KEYS["lm"]]
    # tolerance: no worse than the plain loop summed as the pipeline sums (_ratio, _val_ok: PEER_FACTOR x + floor)
    assert zero[0]["consolidated_ratio"] <= 1
