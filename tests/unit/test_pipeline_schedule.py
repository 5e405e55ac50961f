"""Pipeline pieces that need no process group: schedules (simulated on all stages at once),
partitions, the rank grid, activation headers, PipelineModule layout and names, and a one-stage
pipeline against a plain training loop."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.pipeline import LayerSpec, PipelineGrid, PipelineModule, PipelineStrategy, TiedLayerSpec
from zerotrain.strategies.pipeline.p2p import ActivationMeta
from zerotrain.strategies.pipeline.partition import (partition, partition_balanced, partition_uniform,
                                                     validate_boundaries)
from zerotrain.strategies.pipeline.schedule import (Backward, Forward, LoadMicroBatch, RecvActivation, RecvGrad,
                                                    SendActivation, SendGrad, bubble_fraction, gpipe, inference,
                                                    live_activation_peak, one_f_one_b, steps)
from zerotrain.strategies.precision import Precision
from zerotrain.trainer.module import TrainModule

GRID = list(itertools.product(range(1, 5), range(1, 9)))  # (stages, micro-batches)


# ---------------------------------------------------------------------------- the simulator
class Deadlock(AssertionError):
    pass


#: a send's type -> (direction to its peer, the receive that matches it)
_SENDS = {SendActivation: (+1, RecvActivation), SendGrad: (-1, RecvGrad)}


def simulate(lists: list[list], train: bool = True) -> list[int]:
    """Run every stage's list together with blocking semantics: an exchange (consecutive
    communication instructions) completes only when each of its operations has met the matching
    operation in the peer's current exchange; a receive must match the sender's micro-batch
    (point-to-point traffic between two ranks is first-in first-out). Checks data dependencies
    and returns each stage's peak number of live micro-batch activations."""
    p = len(lists)
    progs = [steps(lst) for lst in lists]
    pc, matched = [0] * p, [set() for _ in range(p)]
    loaded, fwd, bwd = [set() for _ in range(p)], [set() for _ in range(p)], [set() for _ in range(p)]
    got_act, got_grad = [set() for _ in range(p)], [set() for _ in range(p)]
    live, peak = [0] * p, [0] * p

    def current(s):
        return progs[s][pc[s]] if pc[s] < len(progs[s]) else None

    while any(pc[s] < len(progs[s]) for s in range(p)):
        progress = False
        for s in range(p):
            while (ins := current(s)) is not None and not isinstance(ins, list):
                mb = ins.mb
                if isinstance(ins, LoadMicroBatch):
                    assert s in (0, p - 1), f"stage {s} loads data"
                    loaded[s].add(mb)
                elif isinstance(ins, Forward):
                    assert mb not in fwd[s], f"stage {s} forwards {mb} twice"
                    if s == 0 or s == p - 1:
                        assert mb in loaded[s], f"stage {s} forwards {mb} before loading it"
                    if s > 0:
                        assert mb in got_act[s], f"stage {s} forwards {mb} before receiving it"
                    fwd[s].add(mb)
                    if train:
                        live[s] += 1
                        peak[s] = max(peak[s], live[s])
                elif isinstance(ins, Backward):
                    assert mb in fwd[s] and mb not in bwd[s], f"stage {s}: bad backward {mb}"
                    if s < p - 1:
                        assert mb in got_grad[s], f"stage {s} backward {mb} before its gradient"
                    bwd[s].add(mb)
                    live[s] -= 1
                pc[s] += 1
                progress = True
        for s in range(p):
            ex = current(s)
            if not isinstance(ex, list):
                continue
            for j, op in enumerate(ex):
                if j in matched[s] or type(op) not in _SENDS:
                    continue
                delta, recv_type = _SENDS[type(op)]
                peer = s + delta
                assert 0 <= peer < p, f"stage {s} sends {op} to no one"
                assert op.mb in (fwd[s] if delta > 0 else bwd[s]), f"stage {s} sends {op} before computing it"
                pex = current(peer)
                if not isinstance(pex, list):
                    continue
                for k, rop in enumerate(pex):
                    if k not in matched[peer] and type(rop) is recv_type:
                        assert rop.mb == op.mb, f"order mismatch: stage {s} {op} meets stage {peer} {rop}"
                        matched[s].add(j)
                        matched[peer].add(k)
                        (got_act if delta > 0 else got_grad)[peer].add(op.mb)
                        progress = True
                        break
        for s in range(p):
            ex = current(s)
            if isinstance(ex, list) and len(matched[s]) == len(ex):
                pc[s] += 1
                matched[s] = set()
                progress = True
        if not progress:
            raise Deadlock("no stage can move: " + "; ".join(f"stage {s} at {current(s)}" for s in range(p)))
    m = max(max(x.mb for x in lst) for lst in lists) + 1
    for s in range(p):
        assert fwd[s] == set(range(m)), f"stage {s} forwarded {sorted(fwd[s])}"
        assert bwd[s] == (set(range(m)) if train else set()), f"stage {s} backwarded {sorted(bwd[s])}"
    return peak


@pytest.mark.parametrize("stages,micro", GRID)
def test_1f1b_is_deadlock_free_and_bounds_live_activations(stages, micro):
    peak = simulate([one_f_one_b(s, stages, micro) for s in range(stages)])
    assert peak == [min(stages - s, micro) for s in range(stages)]
    assert max(peak) <= stages
    assert peak == [live_activation_peak(one_f_one_b(s, stages, micro)) for s in range(stages)]


@pytest.mark.parametrize("stages,micro", GRID)
def test_gpipe_is_deadlock_free_and_holds_every_micro_batch(stages, micro):
    assert simulate([gpipe(s, stages, micro) for s in range(stages)]) == [micro] * stages


@pytest.mark.parametrize("stages,micro", GRID)
def test_inference_is_deadlock_free(stages, micro):
    simulate([inference(s, stages, micro) for s in range(stages)], train=False)


@pytest.mark.parametrize("stages,micro", GRID)
def test_later_stages_open_with_a_lone_receive(stages, micro):
    # lets the executor send the one-off shape header before the first exchange
    for make in (one_f_one_b, gpipe, inference):
        for s in range(1, stages):
            assert steps(make(s, stages, micro))[0] == [RecvActivation(0)]


def test_simulator_catches_a_deadlock_and_a_misordered_receive():
    bad = [[LoadMicroBatch(0), Forward(0), RecvGrad(0), Backward(0), SendActivation(0)],
           [RecvActivation(0), LoadMicroBatch(0), Forward(0), Backward(0), SendGrad(0)]]
    with pytest.raises(Deadlock):
        simulate(bad)
    swapped = [gpipe(0, 2, 2), gpipe(1, 2, 2)]
    swapped[1] = [RecvActivation(1) if i == RecvActivation(0) else RecvActivation(0) if i == RecvActivation(1)
                  else i for i in swapped[1]]
    with pytest.raises(AssertionError, match="order mismatch"):
        simulate(swapped)


def test_steady_1f1b_pairs_send_with_receive():
    ex = [s for s in steps(one_f_one_b(1, 3, 4)) if isinstance(s, list)]
    assert [SendActivation(1), RecvGrad(0)] in ex and [SendGrad(0), RecvActivation(2)] in ex


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0 and bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)


# ---------------------------------------------------------------------------- partitions and grid
def test_partition_uniform_and_balanced():
    assert partition_uniform(7, 3) == [0, 2, 4, 7]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    assert partition_balanced([10, 0, 10, 0, 10, 0, 10, 0], 2) == [0, 4, 8]
    assert partition_balanced([100, 1, 1, 1, 1, 100], 3) == [0, 1, 5, 6]
    assert partition([5, 5, 5], 3, [0, 1, 2, 3]) == [0, 1, 2, 3]


def test_partition_balanced_is_optimal_on_small_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        w = [int(x) for x in torch.randint(0, 4, (n,), generator=gen) ** 3]
        b = partition_balanced(w, k)
        best = min(max(sum(w[c[i]:c[i + 1]]) for i in range(k))
                   for cuts in itertools.combinations(range(1, n), k - 1) for c in [[0, *cuts, n]])
        assert max(sum(w[b[i]:b[i + 1]]) for i in range(k)) == best
        assert validate_boundaries(b, n, k) == b


@pytest.mark.parametrize("bad", [[0, 2], [0, 2, 2, 4], [1, 2, 4], [0, 3, 2]])
def test_partition_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="boundaries"):
        partition([1, 1, 1, 1], 3 if len(bad) != 3 else 2, bad)
    with pytest.raises(ValueError, match="every stage needs"):
        partition_uniform(2, 3)
    with pytest.raises(ValueError, match="valid choices"):
        partition([1, 1], 2, "flops")


def test_grid():
    g = PipelineGrid(world_size=6, stages=3)
    assert g.replicas == 2 and g.stage_ranks(1) == [3, 4, 5] and g.data_parallel_ranks(2) == [2, 5]
    assert (g.stage_of(4), g.replica_of(4), g.rank_of(1, 1)) == (1, 1, 4)
    assert g.tie_ranks([2, 0], 1) == [3, 5] and g.prev_rank(3) is None and g.next_rank(4) == 5
    with pytest.raises(ValueError, match="not a multiple"):
        PipelineGrid(world_size=6, stages=4)


def test_activation_header_round_trip():
    value = (torch.zeros(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.int64), torch.zeros(()))
    meta = ActivationMeta.of(value)
    assert ActivationMeta.decode(meta.encode()) == meta and meta.grad_positions == [0]
    single = ActivationMeta.of(torch.ones(5, dtype=torch.bfloat16))
    assert ActivationMeta.decode(single.encode()) == single and not single.is_tuple
    with pytest.raises(TypeError, match="tensor or a tuple"):
        ActivationMeta.of((torch.zeros(1), 3))


# ---------------------------------------------------------------------------- PipelineModule
class _Counting(nn.Linear):
    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.weight.device.type != "meta":
            _Counting.built += 1


def _lm_layers(vocab=11, dim=6):
    return [TiedLayerSpec("embed", nn.Embedding, vocab, dim), LayerSpec(_Counting, dim, dim), LayerSpec(nn.GELU),
            LayerSpec(_Counting, dim, dim),
            TiedLayerSpec("embed", nn.Embedding, vocab, dim, forward_fn=lambda emb, h: h @ emb.weight.t())]


def test_layer_specs_are_built_only_on_their_stage_and_keep_sequential_names():
    _Counting.built = 0
    pipe = PipelineModule(_lm_layers(), num_stages=2, partition_method=[0, 2, 5])
    assert _Counting.built == 0 and not pipe.is_built  # counting parameters used the meta device
    pipe.build(1)
    assert _Counting.built == 1 and sorted(pipe.state_dict()) == ["3.bias", "3.weight", "4.weight"]
    assert pipe.owner_stages_of_key("0.weight") == [0, 1] and pipe.owner_stages_of_key("3.bias") == [1]
    assert [t.key for t in pipe.ties] == ["embed"] and pipe.tie_owner_stages(pipe.ties[0]) == [0, 1]
    full = {f"{k}": torch.full((1,), float(i)) for i, k in enumerate(["0.weight", "1.weight", "3.bias", "3.weight",
                                                                     "4.weight"])}
    assert sorted(pipe.stage_state_dict(full)) == ["3.bias", "3.weight", "4.weight"]
    out = pipe(torch.randn(2, 6))
    assert out.shape == (2, 11)


def test_tied_module_on_one_stage_is_one_module():
    pipe = PipelineModule(_lm_layers(), num_stages=1)
    pipe.build(0)
    assert getattr(pipe, "0") is getattr(pipe, "4") and len(pipe.tied_parameters(pipe.ties[0])) == 1


def test_tied_module_with_untied_parameter_across_stages_is_rejected():
    layers = [TiedLayerSpec("t", nn.Linear, 4, 4), LayerSpec(nn.ReLU), TiedLayerSpec("t", nn.Linear, 4, 4)]
    pipe = PipelineModule(layers, num_stages=2, partition_method=[0, 1, 3])
    with pytest.raises(ValueError, match="'bias' is not tied"):
        pipe.build(0)


def test_parameters_partition_balances_counts():
    layers = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU),
              LayerSpec(nn.Linear, 8, 64), LayerSpec(nn.Linear, 64, 8)]
    assert PipelineModule(layers, 2, "parameters").bounds == [0, 5, 6]
    assert PipelineModule(layers, 2, "uniform").bounds == [0, 3, 6]


def test_from_sequential_turns_shared_parameters_into_ties():
    emb, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    pipe = PipelineModule.from_sequential(nn.Sequential(emb, nn.Linear(4, 4), head), 2, partition_method=[0, 1, 3])
    assert [t.members for t in pipe.ties] == [((0, "weight"), (2, "weight"))]
    pipe.build(1)
    assert sorted(pipe.state_dict()) == ["1.bias", "1.weight", "2.weight"]


# ---------------------------------------------------------------------------- one stage, one process
class _LM(TrainModule):
    def __init__(self, layers):
        super().__init__()
        self.pipe = PipelineModule(layers, num_stages=1, loss_fn=lambda out, y: nn.functional.cross_entropy(
            out.flatten(0, 1), y.flatten()))


class _Hooks:
    """What the Trainer lends run_schedule, without callbacks: the pipeline calls only these."""
    accumulation = 1

    def loss_of(self, out):
        return out


@pytest.mark.parametrize("schedule,ckpt", [("1f1b", False), ("gpipe", True)])
def test_one_stage_pipeline_matches_a_plain_loop(schedule, ckpt):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6), nn.Linear(6, 11, bias=False))
    ref[4].weight = ref[0].weight
    model = _LM(_lm_layers())
    strategy = PipelineStrategy(stages=1, schedule=schedule, micro_batches=4, activation_checkpointing=ckpt)
    strategy.connect(ProcessInfo(), torch.device("cpu"), Precision())
    strategy.setup_environment()
    strategy.configure_model(model)
    model.pipe.load_state_dict(model.pipe.stage_state_dict({k: v for k, v in ref.state_dict().items()}))
    strategy.setup_module(model)
    opt = torch.optim.AdamW(strategy.parameters_for_optimizer(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    strategy.setup_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randint(0, 11, (8, 5), generator=gen), torch.randint(0, 11, (8, 5), generator=gen)
        loss = strategy.run_schedule((x, y), i, _Hooks())
        strategy.optimizer_step(0.5)
        ref_loss = nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.pipe.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert strategy.live_activation_peak == (1 if schedule == "1f1b" else 4)
    val = strategy.validation_step((x, y), 0)
    torch.testing.assert_close(val, nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten()).detach())
    with pytest.raises(ValueError, match="divisible by 4"):
        strategy.run_schedule((x[:6], y[:6]), 0, _Hooks())
    for separate in (lambda: strategy.training_step((x, y), 0), lambda: strategy.backward(loss)):
        with pytest.raises(RuntimeError, match="run_schedule"):  # no step of its own, no silent no-op
            separate()
