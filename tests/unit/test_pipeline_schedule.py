"""Pipeline pieces that need no process group: schedules (simulated on all stages at once),
partitions, the rank grid, activation headers, PipelineModule layout and names, and a one-stage
pipeline against a plain training loop."""
from __future__ import annotations

import itertools

import copy

import pytest
import torch
from torch import nn
from tolerance import assert_no_worse_than_peer, backward_per_rank, mean_rtol

from zerotrain.strategies.environment import ProcessInfo
from zerotrain.strategies.pipeline import LayerSpec, PipelineGrid, PipelineModule, PipelineStrategy, TiedLayerSpec
from zerotrain.strategies.pipeline.p2p import ActivationMeta
from zerotrain.strategies.pipeline.partition import (partition, partition_balanced, partition_uniform,
                                                     validate_boundaries)
from zerotrain.strategies.pipeline.schedule import (Backward, Forward, LoadMicroBatch, RecvActivation, RecvGrad,
                                                    SendActivation, SendGrad, WeightGrad, bubble_fraction, bubble_ratio,
                                                    gpipe, inference, interleaved_1f1b, interleaved_slots,
                                                    live_activation_peak, one_f_one_b, peak_live_formula, steps,
                                                    zero_bubble_h1)
from zerotrain.strategies.pipeline.simulate import Deadlock, ScheduleError, simulate_schedule
from zerotrain.strategies.pipeline.simulate import simulate as run_lists
from zerotrain.strategies.precision import Precision
from zerotrain.trainer.api.module import TrainModule

GRID = list(itertools.product(range(1, 5), range(1, 9)))  # (stages, micro-batches)


# ---------------------------------------------------------------------------- the simulator
def simulate(lists: list[list], train: bool = True, virtual_stages: int = 1) -> list[int]:
    """Every stage's list together under blocking exchanges (``simulate.py``): each stage's peak
    number of live (chunk) activations."""
    return run_lists(lists, virtual_stages, train=train).peak_live


@pytest.mark.parametrize("stages,micro", GRID)
def test_1f1b_is_deadlock_free_and_bounds_live_activations(stages, micro):
    peak = simulate([one_f_one_b(s, stages, micro) for s in range(stages)])
    assert peak == [min(stages - s, micro) for s in range(stages)]
    assert max(peak) <= stages
    assert peak == [live_activation_peak(one_f_one_b(s, stages, micro)) for s in range(stages)]


@pytest.mark.parametrize("stages,micro", GRID)
def test_zero_bubble_h1_is_deadlock_free_and_cuts_1f1b_bubble_to_a_third(stages, micro):
    lists = [zero_bubble_h1(s, stages, micro) for s in range(stages)]
    zb = run_lists(lists, forward_cost=1.0, backward_cost=2.0, weight_cost=1.0)
    plain = simulate_schedule(one_f_one_b, stages, micro)
    assert zb.peak_live == plain.peak_live == [min(stages - s, micro) for s in range(stages)]
    # ZB-H1's bubble (p - 1)(F + B - W) against 1F1B's (p - 1)(F + B + W), F = B = W = 1
    assert zb.bubble == pytest.approx((stages - 1) / (3 * micro)) if micro >= stages else zb.bubble < plain.bubble
    for s, lst in enumerate(lists):
        # every micro-batch's weight gradients once, after its backward, at most s backwards late
        order = [(type(i), i.mb) for i in lst if isinstance(i, (Backward, WeightGrad))]
        assert sorted(mb for kind, mb in order if kind is WeightGrad) == list(range(micro))
        for k, (kind, mb) in enumerate(order):
            if kind is WeightGrad:
                assert order.index((Backward, mb)) < k
                assert sum(kind2 is Backward for kind2, _ in order[:k]) <= mb + 1 + s
        # forwards, backwards and communication are 1F1B's, in the same order
        assert [i for i in lst if not isinstance(i, WeightGrad)] == one_f_one_b(s, stages, micro)


def test_zero_bubble_weight_gradients_run_inside_exchanges():
    # stage 1 of 2: each weight gradient after the first backward joins the exchange that sends
    # the gradient and receives the next activation, so it is computed while that is in flight
    grouped = steps(zero_bubble_h1(1, 2, 4))
    assert [RecvActivation(0)] == grouped[0]
    assert [SendGrad(1), WeightGrad(0), RecvActivation(2)] in grouped
    assert grouped[-1] == [SendGrad(3), WeightGrad(2), WeightGrad(3)]
    # the first stage has no exchange after its backwards: its weight gradients follow them
    assert steps(zero_bubble_h1(0, 2, 4))[-2:] == [Backward(3), WeightGrad(3)]


def test_zero_bubble_with_checkpointing_is_a_config_error():
    from zerotrain.trainer.errors import ConfigError
    with pytest.raises(ConfigError, match="zb_h1.*activation_checkpointing"):
        PipelineStrategy(stages=2, schedule="zb_h1", activation_checkpointing=True)
    with pytest.raises(ConfigError, match="virtual_stages"):
        PipelineStrategy(stages=2, schedule="zb_h1", virtual_stages=2, micro_batches=4)


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
    with pytest.raises(ScheduleError, match="order mismatch"):
        simulate(swapped)


def test_steady_1f1b_pairs_send_with_receive():
    ex = [s for s in steps(one_f_one_b(1, 3, 4)) if isinstance(s, list)]
    assert [SendActivation(1), RecvGrad(0)] in ex and [SendGrad(0), RecvActivation(2)] in ex


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0 and bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 16) == pytest.approx(3 / 19)


INTERLEAVED = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p, 16) for v in (2, 3, 4) if m % p == 0]


@pytest.mark.parametrize("stages,micro,virtual", INTERLEAVED)
def test_interleaved_1f1b_is_deadlock_free_and_cuts_the_bubble_by_v(stages, micro, virtual):
    """Every chunk of every micro-batch goes forward and back through the ring with no stage
    stuck, the simulated bubble is the formula's, and the live chunk activations are bounded by
    the warm-up depth."""
    got = simulate_schedule(interleaved_1f1b, stages, micro, virtual)
    assert got.bubble == pytest.approx(bubble_ratio(stages, micro, virtual))
    assert got.idle_fraction == pytest.approx(bubble_fraction(stages, micro, virtual))
    assert got.peak_live == [peak_live_formula(s, stages, micro, virtual) for s in range(stages)]
    for s in range(stages):
        lst = interleaved_1f1b(s, stages, micro, virtual)
        assert live_activation_peak(lst) == got.peak_live[s]
        assert sorted({i.chunk for i in lst}) == list(range(virtual))
        # an exchange talks to each neighbour at most once per direction and kind
        for ex in (x for x in steps(lst) if isinstance(x, list)):
            assert len({type(op) for op in ex}) == len(ex)


@pytest.mark.parametrize("stages,micro,virtual", INTERLEAVED)
def test_interleaved_inference_is_deadlock_free(stages, micro, virtual):
    lists = [interleaved_1f1b(s, stages, micro, virtual, train=False) for s in range(stages)]
    assert simulate(lists, train=False, virtual_stages=virtual) == [0] * stages
    assert all(not isinstance(i, (Backward, RecvGrad, SendGrad)) for lst in lists for i in lst)


@pytest.mark.parametrize("stages,micro", GRID)
def test_one_virtual_stage_is_1f1b_with_the_same_bubble(stages, micro):
    assert interleaved_1f1b(0, stages, micro, 1) == one_f_one_b(0, stages, micro)
    got = simulate_schedule(one_f_one_b, stages, micro)
    assert got.bubble == pytest.approx(bubble_ratio(stages, micro))
    assert got.idle_fraction == pytest.approx(bubble_fraction(stages, micro))
    assert got.peak_live == [peak_live_formula(s, stages, micro) for s in range(stages)]


def test_interleaved_order_cycles_chunks_per_group_of_stages():
    slots = interleaved_slots(1, 2, 4, 2)
    assert slots[0] == [("F", 0, 0)] and slots[2] == [("F", 1, 0), ("B", 1, 0)]
    assert [s[0] for s in slots][:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1)]
    assert [x for s in slots for x in s if x[0] == "B"][:4] == [("B", 1, 0), ("B", 1, 1), ("B", 0, 0), ("B", 0, 1)]


def test_receiving_just_in_time_deadlocks_the_ring():
    """Why the interleaved schedule pairs each send with the next slot's receives: built like
    ``one_f_one_b`` (receive right before, send right after each compute), every stage sends a
    gradient to its previous stage while that one is sending its own."""
    def lazy(stage, p, m, v):
        out = []
        for slot in interleaved_slots(stage, p, m, v):
            for kind, chunk, mb in slot:
                first, last = stage == 0 and chunk == 0, stage == p - 1 and chunk == v - 1
                if kind == "F":
                    out += ([] if first else [RecvActivation(mb, chunk)]) + (
                        [LoadMicroBatch(mb, chunk)] if first or last else []) + [Forward(mb, chunk)] + (
                        [] if last else [SendActivation(mb, chunk)])
                else:
                    out += ([] if last else [RecvGrad(mb, chunk)]) + [Backward(mb, chunk)] + (
                        [] if first else [SendGrad(mb, chunk)])
        return out
    with pytest.raises(Deadlock, match="SendGrad"):
        simulate_schedule(lazy, 2, 4, 2)


#: what bench/schedule_table.py prints (and bench/RESULTS.md "Pipeline schedules" holds):
#: (p, m, v) -> (bubble over the ideal step, peak live chunk activations per stage)
TABLE = {
    (2, 4, 1): (1 / 4, [2, 1]), (2, 4, 2): (1 / 8, [5, 3]),
    (2, 8, 1): (1 / 8, [2, 1]), (2, 8, 2): (1 / 16, [5, 3]),
    (4, 4, 1): (3 / 4, [4, 3, 2, 1]), (4, 4, 2): (3 / 8, [8, 8, 7, 5]),
    (4, 8, 1): (3 / 8, [4, 3, 2, 1]), (4, 8, 2): (3 / 16, [11, 9, 7, 5]),
}


@pytest.mark.parametrize("key", sorted(TABLE))
def test_schedule_table(key):
    from zerotrain.bench.schedule_table import row

    p, m, v = key
    bubble, peak = TABLE[key]
    got = row(p, m, v)
    assert got["bubble"] == pytest.approx(bubble) == pytest.approx(got["bubble_formula"])
    assert got["peak_live"] == peak == got["peak_formula"]
    assert got["idle_fraction"] == pytest.approx(bubble_fraction(p, m, v))


def test_interleaving_requirements_are_config_errors():
    from zerotrain.strategies.pipeline import PipelineConfig
    from zerotrain.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="micro_batches=6 with virtual_stages=2.*multiple of stages=4"):
        PipelineConfig(stages=4, micro_batches=6, virtual_stages=2)
    with pytest.raises(ConfigError, match="schedule='gpipe'"):
        PipelineConfig(schedule="gpipe", virtual_stages=2)
    with pytest.raises(ConfigError, match="at least 2 stages"):
        PipelineConfig(stages=1, virtual_stages=2)
    with pytest.raises(ValueError, match="zero_stage=2; valid choices: 0, 1"):
        PipelineConfig(zero_stage=2)
    assert PipelineConfig(micro_batches=6, virtual_stages=2).virtual_stages == 2  # stages known at set-up


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


def test_virtual_stages_cut_chunks_and_keep_sequential_names():
    pipe = PipelineModule(_lm_layers(), num_stages=2, partition_method=[0, 2, 5])
    with pytest.raises(ValueError, match="cuts 2 stages, not 4 chunks"):  # explicit: give the chunks' cuts
        pipe.set_virtual_stages(2)
    with pytest.raises(ValueError, match="boundaries"):
        pipe.set_virtual_stages(2, [0, 1, 2, 5])
    pipe.set_virtual_stages(2, [0, 1, 2, 4, 5])
    assert pipe.chunk_layers(0) == [range(0, 1), range(2, 4)] and pipe.chunk_layers(1) == [range(1, 2), range(4, 5)]
    assert pipe.owner_stages_of_key("3.weight") == [0] and pipe.tie_owner_stages(pipe.ties[0]) == [0, 1]
    pipe.build(1)
    assert sorted(pipe.state_dict()) == ["1.bias", "1.weight", "4.weight"]
    h = torch.randn(2, 6)
    # tolerance: exact: the same layers, ops and order, chunk by chunk
    torch.testing.assert_close(pipe.forward_chunk(1, pipe.forward_chunk(0, h)), pipe(h), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="before build"):
        pipe.set_virtual_stages(1)
    with pytest.raises(ValueError, match="every stage needs"):  # 5 layers, 6 chunks
        PipelineModule(_lm_layers(), num_stages=2).set_virtual_stages(3)


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


@pytest.mark.parametrize("schedule,ckpt", [("1f1b", False), ("gpipe", True), ("zb_h1", False)])
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
    peer = copy.deepcopy(ref)  # the plain loop summed as the pipeline sums: micro-batch by micro-batch
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=1e-2)

    def ce(net, batch):
        return nn.functional.cross_entropy(net(batch[0]).flatten(0, 1), batch[1].flatten())

    strategy.setup_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses, peer_losses = [], [], []
    for i in range(3):
        x, y = torch.randint(0, 11, (8, 5), generator=gen), torch.randint(0, 11, (8, 5), generator=gen)
        loss = strategy.run_schedule((x, y), i, _Hooks())
        losses.append(loss.detach())
        strategy.optimizer_step(0.5)
        for net, net_opt, out in ((ref, ref_opt, ref_losses), (peer, peer_opt, peer_losses)):
            if net is ref:
                net_loss = ce(ref, (x, y))
                net_loss.backward()
            else:
                micro = list(zip(x.chunk(4), y.chunk(4)))
                net_loss = sum(ce(peer, b).detach() / 4 for b in micro)
                backward_per_rank(peer.parameters(), [micro], lambda b: ce(peer, b))
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            net_opt.step()
            net_opt.zero_grad()
            out.append(net_loss.detach())
    # tolerance: no worse than the plain loop summed as the micro-batches sum (PEER_FACTOR x + 4 ulps), + 2 mean_rtol(n)
    # for the first step's two orders of one mean: n = 8 x 5 tokens
    assert_no_worse_than_peer(torch.stack(losses), torch.stack(ref_losses), torch.stack(peer_losses), "losses",
                              floor=2 * mean_rtol(8 * 5))
    # tolerance: no worse than the plain loop summed as the micro-batches sum (PEER_FACTOR x + 4 ulps)
    assert_no_worse_than_peer({k: model.pipe.state_dict()[k] for k in ref.state_dict()}, ref.state_dict(),
                              peer.state_dict())
    assert strategy.live_activation_peak == (4 if schedule == "gpipe" else 1)
    val = strategy.validation_step((x, y), 0)
    # tolerance: as the losses: the parameters' distance, + 2 mean_rtol(n) for two orders of one mean
    assert_no_worse_than_peer(val, ce(ref, (x, y)).detach(), ce(peer, (x, y)).detach(), "validation",
                              floor=2 * mean_rtol(8 * 5))
    with pytest.raises(ValueError, match="divisible by 4"):
        strategy.run_schedule((x[:6], y[:6]), 0, _Hooks())
    for separate in (lambda: strategy.training_step((x, y), 0), lambda: strategy.backward(loss)):
        with pytest.raises(RuntimeError, match="run_schedule"):  # no step of its own, no silent no-op
            separate()
