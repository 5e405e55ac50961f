"""The sequence-parallel variant of tensor parallelism (strategies/parallel/tensor_sequence.py;
issue 45) on real gloo processes, fp32, against the plain single-process model:

* the demo GPT cut by ``GPT.tp_plan_sequence_parallel`` (``GPTConfig.tp_sequence_parallel``) on
  tp=2, with dropout on (the embeddings', the residual ones', the MLP's; attention dropout off, as
  its masks are each tensor rank's own): one step's loss and every gradient, gathered back, equal
  one process's, and so do three Adam steps' losses and parameters: each rank's dropout draws the
  plain model's mask for its tokens, the norms' parameter gradients are summed over the group;
* the norms' and dropouts' saved activations per rank are exactly half of the plain model's, which
  are the formula's: per norm ``N*C`` inputs and ``2*N`` statistics, per dropout an ``N*C`` mask
  (fp32), N = B*S tokens, C = n_embd;
* attention dropout under tensor parallelism runs in the cut's region (``TensorRNG``): its draws
  are each rank's own (the ranks' heads differ), while the default streams stay in lockstep;
* in the Trainer (``DDP/ZeroStage1/2/3(tensor_parallel=2)`` on a module holding the sequence-parallel
  GPT; ``-m slow``): tp=2 on 2 ranks (DDP, ZeRO-1, ZeRO-3) and dp=2 x tp=2 under ZeRO-1 and ZeRO-2 on
  4 ranks train as the plain loop.

# tolerance: as test_tensor_parallel.py (its derived one-step bound, the issue's 1e-5 for the
# trajectory); the sequence cut adds no sum: the reduce-scatter adds the same two partial sums per
# element as the all-reduce it replaces, and the norm gradients' sum over the group splits the
# token sum in two.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import init_dist, run_ranks
from tolerance import rel_err
from test_tensor_parallel import LR, STEPS, TRAJECTORY_RTOL, _full, _step_bound, _tp_loss
from test_ulysses_gpt import B, CONFIG, S
from zerotrain.examples.gpt import GPT

pytestmark = pytest.mark.timeout(240)

P = 0.1
SP_CONFIG = dataclasses.replace(CONFIG, dropout=P, tp_sequence_parallel=True)


def _model_and_batch(attention_dropout: bool = False):
    torch.manual_seed(5)
    model = GPT(SP_CONFIG)
    if not attention_dropout:
        for block in model.blocks:
            block.attn.dropout = 0.0
    ids = torch.randint(0, CONFIG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(6))
    return model, ids[:, :-1], ids[:, 1:]


class _NormAndDropoutSaved:
    """The bytes the norms' and dropouts' forwards save for backward (``SavedActivations``: each
    storage once, counted whole, parameters left out), over the next forward only."""

    def __init__(self, model: nn.Module) -> None:
        from zerotrain.strategies.memory.saved import SavedActivations
        from zerotrain.strategies.parallel import SequenceParallelDropout, SequenceParallelNorm

        self.saved = SavedActivations(model)
        kinds = (nn.LayerNorm, nn.Dropout, SequenceParallelNorm, SequenceParallelDropout)
        self.handles = [h for m in model.modules() if isinstance(m, kinds) for h in (
            m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave))]

    def _enter(self, *_) -> None:
        self.saved.__enter__()

    def _leave(self, *_) -> None:
        self.saved.__exit__(None, None, None)

    def stop(self) -> None:
        for h in self.handles:
            h.remove()


def _formula_bytes() -> int:
    n, c, layers = B * S, CONFIG.n_embd, CONFIG.n_layer
    norms, dropouts = 2 * layers + 1, 2 * layers + 1  # ln_1, ln_2 per block, ln_f; drop, resid, mlp
    return 4 * (norms * (n * c + 2 * n) + dropouts * n * c)


def _train(model, ids, targets, loss_of) -> dict:
    saved = _NormAndDropoutSaved(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for _ in range(STEPS):
        loss = loss_of(model, ids, targets)
        saved.stop()
        loss.backward()
        first_grads = first_grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "first_grads": first_grads, "saved": saved.saved.bytes}


def _sp_ranks():
    from zerotrain.strategies.parallel import parallelize_tensor

    init_dist()
    group = dist.group.WORLD
    model, ids, targets = _model_and_batch()
    cut = parallelize_tensor(model, group)
    out = _train(model, ids, targets, lambda m, i, t: _tp_loss(m, i, t, group))
    out["grads"] = _gather_grads(model, out.pop("first_grads"), group)
    out.update(params=_full(model, group), cut=cut)
    # attention dropout on: a training step runs it in the cut's tensor-parallel region, whose draws
    # are each rank's own while the default generators stay in lockstep
    for block in model.blocks:
        block.attn.dropout = 0.5
    _tp_loss(model, ids, targets, group).backward()
    attn = model.blocks[0].attn
    with attn.tensor_rng(ids.device):
        region = F.dropout(torch.ones(64), 0.5, training=True)
    out.update(region=region, after=torch.rand(4), rng=type(attn.tensor_rng).__name__)
    return out


def _gather_grads(model, grads: dict, group) -> dict:
    from zerotrain.strategies.parallel import full_tensor

    params = dict(model.named_parameters())
    return {n: full_tensor((params[n], g), group) for n, g in grads.items()}


def _plain() -> dict:
    model, ids, targets = _model_and_batch()

    def loss_of(m, i, t):
        logits, _ = m(i)
        return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), t.reshape(-1))

    out = _train(model, ids, targets, loss_of)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def test_gpt_tp2_sequence_parallel_with_dropout_equals_one_process_and_halves_norm_activations(tmp_path):
    ranks = run_ranks("test_tensor_sequence_parallel:_sp_ranks", 2, tmp_path)
    plain = _plain()
    assert plain["saved"] == _formula_bytes()
    bound = _step_bound()
    for r in ranks:
        assert r["cut"]["ln_f"] == "sequence_parallel" and r["cut"]["drop"] == "sequence_shard"
        assert r["saved"] * 2 == plain["saved"]  # each rank: half the norms' and dropouts' activations
        assert rel_err(r["losses"][0], plain["losses"][0]) <= bound
        assert set(r["grads"]) == set(plain["first_grads"])
        for name, g in plain["first_grads"].items():
            assert rel_err(r["grads"][name], g) <= bound, name
        assert rel_err(r["losses"], plain["losses"]) <= TRAJECTORY_RTOL
        for name, p in plain["params"].items():
            assert rel_err(r["params"][name], p) <= TRAJECTORY_RTOL, name
        assert r["rng"] == "TensorRNG"
    assert not torch.equal(ranks[0]["region"], ranks[1]["region"])  # other heads, another mask
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])  # the default streams in lockstep


# ---------------------------------------------------------------------------- the column layer's saved input
def _colwise_sp_ranks():
    """One ``colwise_sp`` layer on tp=2, fp32 and under bf16 autocast: its output, gradients and the
    bytes it saves for backward, against the same rank's layer on the whole (gathered) input."""
    from zerotrain.strategies.memory.saved import SavedActivations
    from zerotrain.strategies.parallel.tensor import ParallelLinear

    init_dist()
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(3)
    linear, whole = nn.Linear(8, 6), torch.randn(2, 4, 8)
    dy = torch.randn(2, 4, 6)
    layer = ParallelLinear(linear, "colwise_sp", group)
    rows = slice(3 * rank, 3 * rank + 3)  # this rank's output features
    out = {}
    for autocast in (False, True):
        x = whole.chunk(2, dim=1)[rank].clone().requires_grad_()
        layer.zero_grad()
        with SavedActivations(layer) as saved, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = layer(x)
        (y.float() * dy[..., rows]).sum().backward()
        ref_x = whole.clone().requires_grad_()
        ref_w, ref_b = linear.weight.detach()[rows].clone().requires_grad_(), linear.bias.detach()[rows].clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            ref = F.linear(ref_x, ref_w, ref_b)
        (ref.float() * dy[..., rows]).sum().backward()
        full_x = whole.clone().requires_grad_()  # the input's gradient sums both ranks' features
        (F.linear(full_x, linear.weight, linear.bias) * dy).sum().backward()
        out[autocast] = {"saved": saved.bytes, "chunk": x.numel() * x.element_size(), "y": y.detach(),
                         "ref": ref.detach(), "gw": layer.weight.grad.clone(), "ref_gw": ref_w.grad,
                         "gb": layer.bias.grad.clone(), "ref_gb": ref_b.grad, "gx": x.grad.clone(),
                         "ref_gx": full_x.grad.chunk(2, dim=1)[rank],
                         "scale": (dy.abs() @ linear.weight.detach().abs()).chunk(2, dim=1)[rank], "dtypes": (y.dtype, x.grad.dtype, layer.weight.grad.dtype)}
    return out


def test_a_column_parallel_layer_keeps_only_its_inputs_sequence_chunk_for_backward(tmp_path):
    """Megatron's sequence-parallel linear: the layer saves 1/tp of its gathered input (gathered again
    in backward), computes what ``F.linear`` on the whole input computes, fp32 and under autocast.
    Tolerances: the weight's and bias's gradients sum over B*S = 8 tokens (Higham's gamma_n, fp32;
    under bf16 each side rounds once more: 2 u_bf16 = 2**-7), the input's over 6 output features."""
    from tolerance import gamma

    bf16 = 2.0 ** -7
    for r in run_ranks("test_tensor_sequence_parallel:_colwise_sp_ranks", 2, tmp_path):
        for autocast, o in r.items():
            assert o["saved"] == o["chunk"], (autocast, o["saved"], o["chunk"])  # not the gathered 2x
            assert torch.equal(o["y"], o["ref"])  # the same F.linear on the same gathered input
            extra = bf16 if autocast else 0.0
            assert rel_err(o["gw"], o["ref_gw"]) <= 2 * gamma(8) + extra
            assert rel_err(o["gb"], o["ref_gb"]) <= 2 * gamma(8) + extra
            # the input's gradient against fp32 on the whole layer, element by element: per term of its
            # 6-feature sum, bf16 rounds dy, the weight and the partial sum (3 u_bf16 = 3 * 2**-8 < 2**-6)
            bound = (2.0 ** -6 if autocast else 2 * gamma(6)) * o["scale"]
            assert bool(((o["gx"] - o["ref_gx"]).abs() <= bound).all()), autocast
            assert o["dtypes"] == ((torch.bfloat16 if autocast else torch.float32), torch.float32, torch.float32)


# ---------------------------------------------------------------------------- in the Trainer
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
def test_tp2_sequence_parallel_in_the_trainer_trains_as_one_process(tmp_path, strategy):
    from test_tensor_parallel_trainer import _check

    results = run_ranks("test_tensor_parallel_trainer:_fit", 2, tmp_path, timeout=240, tensor_parallel=2, devices=2,
                        strategy=strategy, plan="tp_plan_sequence_parallel")
    assert [r["ln_f"] for r in results] == ["SequenceParallelNorm"] * 2
    _check(results, 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_dp2_by_tp2_sequence_parallel_under_zero_trains_as_one_process(tmp_path, strategy):
    from test_tensor_parallel_trainer import _check

    results = run_ranks("test_tensor_parallel_trainer:_fit", 4, tmp_path, timeout=280, tensor_parallel=2, devices=4,
                        strategy=strategy, plan="tp_plan_sequence_parallel")
    assert [r["tp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["ln_f"] for r in results] == ["SequenceParallelNorm"] * 4
    _check(results, 2)


@pytest.mark.slow
def test_the_cli_key_trains_as_the_plain_loop(tmp_path_factory):
    """``model.tp_sequence_parallel=true strategy=ddp strategy.tensor_parallel=2``: the demo GPT cut by
    its sequence-parallel plan; every logged loss equals the plain loop's, and the sample at the end
    (drawn from the shards gathered whole on rank 0) is printed."""
    from test_pipeline_cli import STEPS as CLI_STEPS, _cli, _logged_losses, _reference, _root

    run_dir = _cli(_root(tmp_path_factory), "ddp_tp2_sp", 2, 1, "strategy=ddp", "strategy.tensor_parallel=2",
                   "model.tp_sequence_parallel=true", "trainer.enable_checkpointing=false", "sample_tokens=8")
    got = _logged_losses(run_dir)
    assert [got[s] for s in range(1, CLI_STEPS + 1)] == pytest.approx(_reference()["losses"][1], rel=TRAJECTORY_RTOL)
    stdout = (run_dir / "stdout.txt").read_text()
    assert stdout.count("----- sample -----") == 1, stdout[-2000:]
