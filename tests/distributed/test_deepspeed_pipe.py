"""``zerotrain.deepspeed.pipe`` on 2 real gloo processes against a plain single-process PyTorch run.

A script written as DeepSpeed's pipeline examples are (``PipelineModule`` of ``LayerSpec`` /
``TiedLayerSpec`` layers, ``deepspeed.initialize`` with DeepSpeed's batch keys, ``train_batch``
from an iterator, ``eval_batch``) trains a small MLP:

* ``two_stages``: 2 stages x 1 replica, 4 micro-batches per step, clipping on;
* ``two_replicas``: 1 stage x 2 replicas (the data-parallel dimension: ``train_batch_size`` =
  micro x accumulation x replicas), reading ``initialize(training_data=...)`` (``train_batch()``
  without an iterator);
* ``tied``: 2 stages whose first and last layers are one ``TiedLayerSpec`` weight (an embedding
  reused as the head): each stage holds a copy, their gradients are summed across the stages.

The reference is the same layers as one module in one process, trained with
``torch.optim.AdamW`` from the weights each rank started with (the ranks return them): each
replica's micro-batches' gradients accumulated, the replicas averaged, then clipped as DeepSpeed
0.19.8 clips a pipeline in fp32 without ZeRO: by the norm of the FIRST stage's gradients only
(``clip_fp32_gradients`` counts model-parallel rank 0's parameters, and a pipeline's stages are its
model-parallel ranks), every stage's gradients scaled by that coefficient. DeepSpeedExamples'
AlexNet pipeline differs from DeepSpeed by 1.8e-3 at its third step without this rule.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from harness import run_ranks_once
from tolerance import EPS32, FLOOR_ULPS, assert_no_worse_than_peer, gamma, mean_rtol

STEPS, MICRO, GAS, WIDTH, CLASSES = 3, 4, 4, 16, 4
CLIP, LR = 0.1, 0.01  # CLIP: below the gradient norms here, so every step clips


def _data(seed: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(MICRO, WIDTH, generator=g), torch.randint(0, CLASSES, (MICRO,), generator=g))
            for _ in range(rows)]


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """``two_replicas`` trains from ``initialize(training_data=...)``: each replica reads every
    second row (DeepSpeed's DistributedSampler without shuffling), MICRO rows a micro-batch."""
    g = torch.Generator().manual_seed(5)
    rows = STEPS * GAS * MICRO * 2
    return torch.randn(rows, WIDTH, generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def _micro_batches(case: str, replica: int, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches replica ``replica`` trains on, in order."""
    if case != "two_replicas":
        return _data(100 + replica, STEPS * GAS)
    x, y = (t[replica::replicas] for t in _dataset())
    return [(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, len(x), MICRO)]


def _tied_head(emb: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The tied weight's second use: logits against the embedding's first rows."""
    return x @ emb.weight[:CLASSES].t()


def _layers(case: str):
    from zerotrain.deepspeed.pipe import LayerSpec, TiedLayerSpec

    if case == "tied":
        return [TiedLayerSpec("emb", nn.Linear, WIDTH, WIDTH, bias=False), nn.Tanh(),
                LayerSpec(nn.Linear, WIDTH, WIDTH), nn.Tanh(),
                TiedLayerSpec("emb", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=_tied_head)]
    return [LayerSpec(nn.Linear, WIDTH, WIDTH), nn.Tanh(), LayerSpec(nn.Linear, WIDTH, WIDTH), nn.Tanh(),
            LayerSpec(nn.Linear, WIDTH, CLASSES)]


def _stages(case: str) -> int:
    return 1 if case == "two_replicas" else 2


def pipe_rank(case: str) -> dict:
    """One rank of the DeepSpeed-style script (the test process is the reference)."""
    from harness import init_dist

    import zerotrain.deepspeed as deepspeed
    from zerotrain.deepspeed.pipe import PipelineModule

    from zerotrain.trainer.errors import ConfigError

    rank, world = init_dist()
    if case == "two_stages":  # bad input: refused with the field, the value and what is valid
        with pytest.raises(ConfigError, match="num_stages=3; valid: a divisor of the world size 2"):
            PipelineModule(layers=_layers(case), loss_fn=nn.CrossEntropyLoss(), num_stages=3)
        with pytest.raises(ConfigError, match="zero_optimization.stage=2 .* valid: stage 0 or 1"):
            deepspeed.initialize(model=PipelineModule(layers=_layers(case), loss_fn=nn.CrossEntropyLoss(),
                                                      num_stages=2),
                                 config={"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    torch.manual_seed(1234)
    net = PipelineModule(layers=_layers(case), loss_fn=nn.CrossEntropyLoss(), num_stages=_stages(case),
                         partition_method="uniform" if case == "tied" else "parameters")
    built = sorted(int(n) for n, _ in net.named_children())
    config = {"train_batch_size": MICRO * GAS * (world // _stages(case)), "train_micro_batch_size_per_gpu": MICRO,
              "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}}
    data = torch.utils.data.TensorDataset(*_dataset()) if case == "two_replicas" else None
    engine, _, loader, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                                config=config, training_data=data)
    assert (loader is None) == (data is None)
    start = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    replica = engine.zerotrain_strategy.data_parallel_rank
    it = None if data is not None else iter(_micro_batches(case, replica, world // _stages(case)))
    losses = [engine.train_batch(it) for _ in range(STEPS)]
    eval_loss = engine.eval_batch(iter(_data(999, GAS)))
    with pytest.raises(ConfigError, match="return_logits=True; valid: False"):
        engine.eval_batch(iter(_data(999, GAS)), return_logits=True)
    final = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    # save, train a step, load, train the same step again: the same loss, counters and client state
    ckpt = Path(os.environ["ZT_TEST_RESULT"]).parent / f"ckpt_{case}"
    engine.save_checkpoint(ckpt, client_state={"epoch": 7})
    after_save = engine.train_batch(iter(_data(555, GAS)))
    path, client = engine.load_checkpoint(ckpt)
    assert Path(path).name == f"global_step{STEPS}" and client == {"epoch": 7} and engine.global_steps == STEPS
    after_load = engine.train_batch(iter(_data(555, GAS)))
    with pytest.raises(Exception, match="only train_batch"):
        engine(torch.zeros(1))
    return {"rank": rank, "stage": engine.stage_id, "replica": replica, "built": torch.tensor(built),
            "first": engine.is_first_stage(), "last": engine.is_last_stage(), "micro_batches": engine.micro_batches,
            "gas": engine.gradient_accumulation_steps(), "train_batch_size": engine.train_batch_size(),
            "losses": torch.stack([torch.as_tensor(x).reshape(()) for x in losses]),
            "eval": torch.as_tensor(eval_loss).reshape(()), "start": start, "final": final,
            "resumed": torch.stack([after_save.reshape(()), after_load.reshape(())])}


# ---------------------------------------------------------------------------- the reference
class Plain(nn.Module):
    """The pipeline's layers in one module (a tied weight is one module used twice)."""

    def __init__(self, case: str, start: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.case = case
        self.l0 = nn.Linear(WIDTH, WIDTH, bias=case != "tied")
        self.l2 = nn.Linear(WIDTH, WIDTH)
        self.l4 = None if case == "tied" else nn.Linear(WIDTH, CLASSES)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(start[name[1:]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l0(x))))
        return _tied_head(self.l0, h) if self.case == "tied" else self.l4(h)


#: the parameters of the first stage (DeepSpeed's cut), whose gradients alone DeepSpeed's fp32
#: pipeline clipping norm counts (``clip_fp32_gradients``: model-parallel rank 0 = stage 0)
FIRST_STAGE = {"two_stages": ("l0.",), "tied": ("l0.", "l2."), "two_replicas": ("l0.", "l2.", "l4.")}
#: per case and step: (the coefficient applied, the one the full norm would have given)
CLIPPED: dict = {}


def _clip_as_deepspeed(model: nn.Module, case: str) -> None:
    """Scale every gradient by max_norm / (the first stage's gradient norm + 1e-6), at most 1."""
    grads = [p.grad for n, p in model.named_parameters() if n.startswith(FIRST_STAGE[case])]
    first = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    full = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    coef = torch.clamp(CLIP / (first + 1e-6), max=1.0)
    CLIPPED.setdefault(case, []).append((float(coef), float(torch.clamp(CLIP / (full + 1e-6), max=1.0))))
    for p in model.parameters():
        p.grad.mul_(coef)


def _reference(case: str, start: dict, replicas: int, reverse: bool) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Per-step losses, final weights and the eval loss of the plain run; ``reverse`` sums each
    replica's micro-batch gradients in the opposite order (an equally valid fp32 order: the peer)."""
    model = Plain(case, start)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = [_micro_batches(case, r, replicas) for r in range(replicas)]
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for step in range(STEPS):
        grads, step_loss = [], torch.zeros(())
        for r in range(replicas):
            micro = data[r][step * GAS:(step + 1) * GAS]
            acc = None
            for x, y in (reversed(micro) if reverse else micro):
                loss = loss_fn(model(x), y) / GAS
                step_loss = step_loss + loss.detach() / replicas
                g = torch.autograd.grad(loss, list(model.parameters()))
                acc = g if acc is None else [a + b for a, b in zip(acc, g)]
            grads.append(acc)
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] / replicas for g in grads)
        _clip_as_deepspeed(model, case)
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
    with torch.no_grad():
        eval_loss = sum(loss_fn(model(x), y) for x, y in _data(999, GAS)) / GAS
    final = {n[1:]: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(losses), final, eval_loss


def _start(results: list[dict]) -> dict[str, torch.Tensor]:
    """The initial weights, from the stage that holds each (a tied one from its first holder)."""
    start: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r["start"].items():
            start.setdefault(k, v)
    return start


def _final(results: list[dict], case: str) -> dict[str, torch.Tensor]:
    final: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r["final"].items():
            if case == "tied" and k == "4.weight":
                k = "0.weight"
            final.setdefault(k, v)
    return final


_RUNS: dict = {}


def _results(case: str, tmp_path_factory) -> list[dict]:
    return run_ranks_once(_RUNS, case, "test_deepspeed_pipe:pipe_rank", 2, tmp_path_factory, timeout=120, case=case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["two_stages", "two_replicas", "tied"])
def test_train_batch_matches_plain_pytorch(case, tmp_path_factory):
    results = _results(case, tmp_path_factory)
    replicas = 2 // _stages(case)
    for r in results:
        assert r["micro_batches"] == r["gas"] == GAS
        assert r["train_batch_size"] == MICRO * GAS * replicas
    want_losses, want_final, want_eval = _reference(case, _start(results), replicas, reverse=False)
    peer_losses, peer_final, _ = _reference(case, _start(results), replicas, reverse=True)
    # tolerance: no worse than the peer (the same run with each replica's micro-batch gradients
    # summed in the opposite order, an equally valid fp32 order) x PEER_FACTOR + FLOOR_ULPS ulps
    # (tests/tolerance.py); the first step's loss, before any update, is within that floor
    for r in results:  # every rank returns the same mean loss, as DeepSpeed broadcasts it
        assert_no_worse_than_peer(r["losses"], want_losses, peer_losses, what=f"rank {r['rank']} losses")
    got = _final(results, case)
    assert sorted(got) == sorted(want_final)
    assert_no_worse_than_peer(got, want_final, peer_final, what="final weights ")
    # tolerance: eval is one forward of the final weights: each Linear's dot products (length
    # WIDTH + 1 with the bias) in another fp32 order, 3 layers, and the mean over GAS micro-batches
    # in another grouping, over the drift the final weights already have (their peer bound)
    drift = max(FLOOR_ULPS * EPS32, 4 * max((got[k] - want_final[k]).norm().item() / want_final[k].norm().item()
                                             for k in got))
    bound = 2 * (3 * gamma(WIDTH + 1) + mean_rtol(GAS)) + 3 * drift
    for r in results:
        assert abs(r["eval"].item() - want_eval.item()) <= bound * abs(want_eval.item()), (r["eval"], want_eval)


@pytest.mark.timeout(300)
def test_clipping_uses_the_first_stages_norm(tmp_path_factory):
    """Every step clips, and the first stage's norm gives another coefficient than the full norm:
    so matching the reference above means clipping by the first stage's norm, as DeepSpeed. (In
    ``tied`` the second stage holds only the tied weight, whose summed gradient the first stage
    counts: both norms are the plain model's.)"""
    case = "two_stages"
    results = _results(case, tmp_path_factory)
    CLIPPED.pop(case, None)
    _reference(case, _start(results), 1, reverse=False)
    assert any(first < 1.0 and abs(first - full) > 1e-3 * first for first, full in CLIPPED[case]), CLIPPED[case]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["two_stages", "tied"])
def test_checkpoint_round_trip(case, tmp_path_factory):
    """save_checkpoint, a step, load_checkpoint, the same step: the same loss, bit for bit."""
    for r in _results(case, tmp_path_factory):
        assert r["resumed"][0].item() == r["resumed"][1].item(), r["resumed"]


@pytest.mark.timeout(300)
def test_stages_build_only_their_layers(tmp_path_factory):
    """LayerSpec layers are built on the stage that owns them only; DeepSpeed's stage queries."""
    results = _results("two_stages", tmp_path_factory)
    by_stage = {r["stage"]: r for r in results}
    assert sorted(by_stage) == [0, 1]
    # 'parameters': layers 0..4 weigh 272, 0, 272, 0, 68 -> DeepSpeed's cut [0, 2, 5]
    assert by_stage[0]["built"].tolist() == [0, 1] and by_stage[1]["built"].tolist() == [2, 3, 4]
    assert (by_stage[0]["first"], by_stage[0]["last"], by_stage[1]["first"], by_stage[1]["last"]) == \
        (True, False, False, True)


@pytest.mark.timeout(300)
def test_tied_copies_stay_equal(tmp_path_factory):
    """Each stage holding the tied weight keeps a copy; summed gradients keep the copies equal."""
    results = _results("tied", tmp_path_factory)
    by_stage = {r["stage"]: r for r in results}
    assert torch.equal(by_stage[0]["start"]["0.weight"], by_stage[1]["start"]["4.weight"])
    assert torch.equal(by_stage[0]["final"]["0.weight"], by_stage[1]["final"]["4.weight"])
    assert not torch.equal(by_stage[0]["final"]["0.weight"], by_stage[0]["start"]["0.weight"])

