"""ZeRO++'s quantized communication on 2 real gloo processes, through the real Trainer, on the demo
GPT: ``quantize_weights`` (qwZ, zero3) and ``quantize_gradients`` (qgZ, zero2 and zero3) against the
exact runs of the same strategy (same seed, weights and batches).

* the loss tracks the exact run: every step within ``LOSS_RTOL`` of it (int8 with 256-element
  blocks rounds each value by at most 1/254 of its block's largest magnitude);
* the bytes: every step's bytes per collective equal the CommsLogger's formula, and the quantized
  collectives carry 1/4 of the fp32 bytes plus the scales (4 bytes per 256 elements): a ratio of
  (1 + 4/256) / 4 = 0.254, within the padding of the pieces to whole blocks;
* the exact paths are the code the other suites test: with the options off nothing is quantized
  (no all_to_all, fp32-sized gathers);
* ``hierarchical_partition`` (hpZ), on 2 ranks as 2 nodes of 1 and (slow) 4 ranks as 2 nodes of 2
  (``LOCAL_WORLD_SIZE``): the same losses bit for bit as plain zero3, and the backward gathers
  leave the node never (nodes of 1: no bytes at all; nodes of 2: all-gathers over 2 ranks).
"""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks_once
from zerotrain.bench.zeropp_bench import LOSS_CASES

STEPS = 12
#: relative loss difference allowed at every step, a sanity bound (int8 against exact is no fp32
#: equivalence): 1.3 x one value's worst int8 rounding, 1/254 of its block's absmax (~5e-3); measured
#: at most 2.7e-4 (qwZ), 2.4e-4 (qgZ, either stage), 3.9e-4 (both) over the 12 steps
LOSS_RTOL = 1.3 / 254
#: bytes of a quantized collective over its fp32 form: (1 + 4/256) / 4 = 0.2539, plus padding
RATIO = (0.25, 0.26)

#: zero3 and zero2, exact and with each option (the benchmark's cases)
CASES = LOSS_CASES


def _fit(strategy: str, options: dict, corpus: str) -> dict:
    import os

    from zerotrain import Callback, Trainer
    from zerotrain.callbacks import CommsLogger
    from zerotrain.examples.gpt import GPTConfig
    from zerotrain.examples.gpt_module import GPTModule
    from zerotrain.strategies import strategy_from_name

    class Losses(Callback):
        def __init__(self):
            self.values, self.buffers = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.values.append(float(loss))
            self.buffers.append(len(trainer.strategy.memory_tensors()["comm_buffers"]))

    torch.manual_seed(0)
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    module = GPTModule(config, batch_size=4, data_path=corpus, max_bytes=40_000, max_steps=STEPS,
                       warmup_steps=1, val_fraction=0)
    comms, losses = CommsLogger(), Losses()
    trainer = Trainer(strategy=strategy_from_name(strategy, **options), devices=int(os.environ["WORLD_SIZE"]),
                      accelerator="cpu", max_steps=STEPS, gradient_clip_val=1.0, callbacks=[comms, losses],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, seed=0)
    trainer.fit(module)
    return {"losses": losses.values, "buffers": losses.buffers, "expected": comms.expected,
            "expected_first": comms.expected_first,
            "step_bytes": {int(k): v for k, v in comms.step_bytes.items()},
            "gather_groups": sorted({row["group_size"] for row in comms.summary if row["op"] == "all_gather"})}


def _worker(corpus: str) -> dict:
    return {name: _fit(strategy, options, corpus) for name, (strategy, options) in CASES.items()}


_SPAWNED: dict = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from zerotrain.examples.data import stdlib_corpus

    path = tmp_path_factory.mktemp("zeropp") / "corpus.txt"
    path.write_bytes(stdlib_corpus(40_000))
    return run_ranks_once(_SPAWNED, 2, "test_zeropp:_worker", 2, tmp_path_factory, timeout=300,
                          corpus=str(path))[0]


@pytest.mark.parametrize("case", ["zero3_qw", "zero3_qg", "zero3_qwqg", "zero2_qg"])
def test_loss_tracks_the_exact_run(runs, case):
    exact = torch.tensor(runs[case.split("_")[0]]["losses"])
    got = torch.tensor(runs[case]["losses"])
    assert len(got) == len(exact) == STEPS
    # tolerance: a sanity bound, not an equivalence: int8 blocks round each value by <= 1/254 of its block's absmax; LOSS_RTOL ~ 1.3/254
    torch.testing.assert_close(got, exact, rtol=LOSS_RTOL, atol=0)
    assert not torch.equal(got, exact)  # something really was quantized


@pytest.mark.parametrize("case", list(CASES))
def test_communication_buffers_stop_growing_after_the_first_steps(runs, case):
    """The pooled buffers (the exact path's, and ZeRO++'s int8 codes, scales and pieces) are given
    back after each collective: their number is set by the first steps and never grows after."""
    counts = runs[case]["buffers"]
    assert len(counts) == STEPS and counts[2:] == [counts[2]] * (STEPS - 2), counts


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_per_step_match_the_formula(runs, case):
    run = runs[case]
    assert sorted(run["step_bytes"]) == list(range(STEPS))
    for step, by_op in run["step_bytes"].items():
        want = run["expected_first"] if step == 0 else run["expected"]  # zero3 reuses from step 1
        assert by_op == want, (step, by_op, want)


def test_quantized_weights_gather_a_quarter_of_the_fp32_bytes(runs):
    exact, qw = runs["zero3"]["expected"], runs["zero3_qw"]["expected"]
    assert RATIO[0] <= qw["all_gather"] / exact["all_gather"] <= RATIO[1]
    assert qw["reduce_scatter"] == exact["reduce_scatter"]  # gradients untouched


def test_quantized_gradients_move_a_quarter_of_the_fp32_bytes(runs):
    for stage in ("zero3", "zero2"):
        exact, qg = runs[stage]["expected"], runs[f"{stage}_qg"]["expected"]
        # on 2 gloo ranks zero3 reduces by reduce-scatter, zero2 by reduce to the owners (the
        # all-reduce is the clip by norm's: the per-parameter norms and the boundary-cut parameters,
        # grad_norm.py; the same bytes whether the gradients travel quantized or not)
        assert exact["all_reduce"] > 0
        grads = exact.get("reduce_scatter", 0) + exact.get("reduce", 0)
        assert "reduce_scatter" not in qg and qg["all_reduce"] == exact["all_reduce"]
        assert RATIO[0] <= qg["all_to_all"] / grads <= RATIO[1]
        for key in ("all_gather", "broadcast"):
            assert qg.get(key) == exact.get(key)  # parameters untouched
    both = runs["zero3_qwqg"]["expected"]
    assert both["all_gather"] == runs["zero3_qw"]["expected"]["all_gather"]
    assert both["all_to_all"] == runs["zero3_qg"]["expected"]["all_to_all"]


def test_exact_runs_send_nothing_quantized(runs):
    for stage in ("zero3", "zero2"):
        assert "all_to_all" not in runs[stage]["expected"]


# ---------------------------------------------------------------------------- hpZ
#: hierarchical_partition on 2 ranks as 2 "nodes" of 1 (LOCAL_WORLD_SIZE=1, the shape of the
#: 2-namespace multi-node set-up): backward gathers read the node copy and send nothing
#: (max_reuse_distance=0: every block is gathered again in backward, the gathers hpZ moves)
_LEAN = {"max_reuse_distance": 0}
HPZ_CASES = {"zero3": ("zero3", _LEAN), "zero3_hpz": ("zero3", {**_LEAN, "hierarchical_partition": True}),
             "zero3_hpz_qw": ("zero3", {**_LEAN, "hierarchical_partition": True, "quantize_weights": True})}
_HPZ: dict = {}


def _hpz_worker(corpus: str) -> dict:
    return {name: _fit(strategy, options, corpus) for name, (strategy, options) in HPZ_CASES.items()}


def hpz_spawn(world: int, local: int, tmp_path_factory) -> dict:
    """Rank 0's results of ``world`` ranks in nodes of ``local`` (LOCAL_WORLD_SIZE), one spawn each."""
    from zerotrain.examples.data import stdlib_corpus

    path = tmp_path_factory.mktemp("hpz") / "corpus.txt"
    path.write_bytes(stdlib_corpus(40_000))
    return run_ranks_once(_HPZ, (world, local), "test_zeropp:_hpz_worker", world, tmp_path_factory, timeout=300,
                          env={"LOCAL_WORLD_SIZE": str(local)}, corpus=str(path))[0]


def test_hierarchical_partition_changes_no_number_and_keeps_backward_gathers_in_the_node(tmp_path_factory):
    hpz_runs = hpz_spawn(2, 1, tmp_path_factory)
    exact, hpz = hpz_runs["zero3"], hpz_runs["zero3_hpz"]
    assert hpz["losses"] == exact["losses"]  # the node copy holds the gathered values exactly
    for run in hpz_runs.values():
        for by_op in run["step_bytes"].values():
            assert by_op == run["expected"]
    # forward: every unit once; backward: the blocks again from the node copy (no bytes here)
    assert hpz["expected"]["all_gather"] < 0.75 * exact["expected"]["all_gather"]
    # with qwZ the forward gathers are int8, the backward ones exact copies within the node
    qw = hpz_runs["zero3_hpz_qw"]
    # tolerance: a sanity bound, not an equivalence: int8 blocks round each value by <= 1/254 of its block's absmax; LOSS_RTOL ~ 1.3/254
    torch.testing.assert_close(torch.tensor(qw["losses"]), torch.tensor(exact["losses"]), rtol=LOSS_RTOL, atol=0)
    assert qw["expected"]["all_gather"] < 0.3 * hpz["expected"]["all_gather"]


@pytest.mark.slow
def test_hierarchical_partition_on_two_nodes_of_two_ranks(tmp_path_factory):
    """4 ranks as 2 nodes of 2: backward gathers go over the 2 ranks of the node."""
    runs = hpz_spawn(4, 2, tmp_path_factory)
    assert runs["zero3_hpz"]["losses"] == runs["zero3"]["losses"]
    assert runs["zero3"]["gather_groups"] == [4] and runs["zero3_hpz"]["gather_groups"] == [2, 4]
    assert runs["zero3_hpz"]["expected"] == runs["zero3"]["expected"]  # same bytes, half the ranks
    for run in runs.values():
        for by_op in run["step_bytes"].values():
            assert by_op == run["expected"]
