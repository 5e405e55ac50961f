"""zerotrain-tune's search without processes: the space keeps the global batch, the estimate prunes
exactly what breaks the cap, runs are interleaved and ranked, the tuned config composes back into
the winner's config, the chart is a valid PNG, and bad input stops the command before any run."""
import json
import struct
import zlib

import pytest
from omegaconf import OmegaConf

from zerotrain.strategies.zero.estimate import estimate_model_states
from zerotrain.trainer.command import tune_search as T
from zerotrain.trainer.command.chart import Point, _raster, scatter_png, write_png

GiB = 2**30


# ---------------------------------------------------------------------- the space
def test_space_keeps_the_global_batch():
    space = T.search_space(T.STRATEGIES, 16, [16, 8, 4], [1.0, 0.25])
    assert {c.micro_batch * c.accumulate for c in space} == {16}
    assert {(c.micro_batch, c.accumulate) for c in space} == {(16, 1), (8, 2), (4, 4)}
    # 3 micro-batches x 2 buckets, and x 2 for zero3's activation checkpointing
    assert {s: sum(c.strategy == s for c in space) for s in T.STRATEGIES} == \
        {"ddp": 6, "zero1": 6, "zero2": 6, "zero3": 12, "offload": 6}
    assert not any(c.checkpointing for c in space if c.strategy != "zero3")
    assert len(set(space)) == len(space)


def test_default_micro_batches_and_buckets():
    assert T.micro_batch_choices(16) == [16, 8]
    assert T.micro_batch_choices(5) == [5]
    assert T.bucket_choices("ddp", [1, 0.25]) == [25.0, 6.25]
    assert T.bucket_choices("zero2", [1, 0.25]) == [5_000_000, 1_250_000]
    assert T.bucket_choices("zero3", [1, 1.0]) == [10_000_000]  # duplicates collapse


def test_candidate_overrides_select_the_configuration():
    c = T.Candidate("zero2", 8, 2, 1_250_000)
    assert c.overrides() == ["strategy=zero2", "strategy.reduce_bucket_size=1250000",
                             "strategy.allgather_bucket_size=1250000", "data.batch_size=8",
                             "trainer.accumulate_grad_batches=2"]
    assert "strategy.activation_checkpointing=true" in T.Candidate("zero3", 16, 1, 5e7, True).overrides()


@pytest.mark.parametrize("call,expected", [
    (lambda: T.check_strategies(["ddp", "zero9"]), "--strategies='zero9': is not a strategy"),
    (lambda: T.check_strategies([]), "--strategies='': is empty"),
    (lambda: T.micro_batch_choices(16, [5]), "--micro-batches=5: must divide the 16 samples"),
    (lambda: T.check_cap(-1.0), "--max-rss-gb=-1.0: must be a finite number of GiB > 0"),
    (lambda: T.check_cap(float("nan")), "--max-rss-gb=nan"),
    (lambda: T.check_margin(-0.5), "--margin=-0.5"),
])
def test_bad_search_input_names_the_field(call, expected):
    with pytest.raises(T.TuneError) as info:
        call()
    assert expected in str(info.value) and "valid: " in str(info.value), str(info.value)


# ---------------------------------------------------------------------- estimate and pruning
def _memory(num_params=1_000_000, world=2, precision="32"):
    return T.MemoryModel(num_params, world, precision, base_bytes=GiB // 4,
                         activation_bytes=lambda m, ckpt: m * (2**20 if not ckpt else 2**18))


def test_estimate_adds_base_states_and_the_larger_of_backward_and_step():
    m = _memory()
    states = estimate_model_states(1_000_000, 2, "32")
    ddp, z3 = T.estimate(T.Candidate("ddp", 8, 2, 25.0), m), T.estimate(T.Candidate("zero3", 8, 2, 5e7), m)
    assert ddp == {"base": GiB // 4, "states": states["ddp"].total, "activations": 8 * 2**20,
                   "in_flight": 2 * 1_000_000, "step": 13 * 1_000_000,
                   "total": GiB // 4 + states["ddp"].total + max(8 * 2**20 + 2_000_000, 13_000_000)}
    assert z3["states"] == states["zero3"].total and z3["in_flight"] == 12 * 1_000_000
    assert z3["step"] == 13 * 500_000  # the partition this rank steps
    assert T.estimate(T.Candidate("zero3", 8, 2, 5e7, True), m)["activations"] == 8 * 2**18
    assert T.estimate(T.Candidate("offload", 8, 2, 5e6), m)["states"] == states["zero2"].total
    bf16_true = T.estimate(T.Candidate("ddp", 8, 2, 25.0), _memory(precision="bf16-true"))["states"]
    assert bf16_true == 1_000_000 * (2 + 2 + 4)
    # small activations: the optimizer step's temporaries are the peak
    tiny = T.MemoryModel(1_000_000, 2, "32", 0, lambda mb, ckpt: 0)
    assert T.estimate(T.Candidate("ddp", 1, 16, 25.0), tiny)["total"] == states["ddp"].total + 13_000_000


def test_demo_gpt_estimate_sits_just_under_the_sweeps_measured_peaks():
    """The constants were fitted to the 21M GPT's sweep (bench/RESULTS.md, 2026-12-01 06:51): the
    estimate lies in 0.88-1.00x of each measured peak RSS, so with the 10% margin it neither prunes
    a configuration that fits with that headroom nor lets through one far over it. A change to the
    estimate's terms that breaks this shows here."""
    from zerotrain.examples import gpt_cli as app
    from zerotrain.examples.gpt import GPTConfig

    cfg = GPTConfig(block_size=256, n_layer=4, n_head=8, n_embd=512, vocab_size=16384)
    m = T.MemoryModel(app.num_params(cfg), 2, "32", int(0.326 * GiB),
                      lambda mb, ckpt: app.activation_bytes(cfg, mb, ckpt, "32"))
    measured = {  # configuration: the larger rank's peak RSS in the sweep, GiB
        ("ddp", 4, 25.0, False): 1.013, ("ddp", 2, 25.0, False): 0.931, ("zero1", 4, 5e6, False): 0.920,
        ("zero1", 2, 5e6, False): 0.756, ("zero2", 4, 5e6, False): 0.973, ("zero2", 2, 5e6, False): 0.814,
        ("offload", 2, 1.25e6, False): 0.805, ("zero3", 4, 5e7, False): 1.063, ("zero3", 2, 5e7, False): 0.922,
        ("zero3", 4, 1.25e7, True): 0.978, ("zero3", 2, 1.25e7, True): 0.891, ("zero3", 2, 5e7, True): 0.937}
    for (s, mb, bucket, ckpt), peak in measured.items():
        ratio = T.estimate(T.Candidate(s, mb, 4 // mb, bucket, ckpt), m)["total"] / GiB / peak
        assert 0.88 <= ratio <= 1.005, (s, mb, bucket, ckpt, ratio)


def test_prune_removes_exactly_what_breaks_the_cap():
    m, margin = _memory(num_params=20_000_000), 0.1
    ddp, zero3 = T.Candidate("ddp", 16, 1, 25.0), T.Candidate("zero3", 16, 1, 5e7)
    need = {c: T.estimate(c, m)["total"] * (1 + margin) for c in (ddp, zero3)}
    assert need[zero3] < need[ddp]
    cap = (need[zero3] + need[ddp]) / 2
    kept, pruned = T.prune([ddp, zero3], m, cap, margin)
    assert kept == [zero3] and list(pruned) == [ddp]
    assert "incl. 10% margin" in pruned[ddp] and f"cap {cap / GiB:.3f} GiB" in pruned[ddp]
    # at exactly the estimate with its margin a configuration fits; a byte less and it does not
    assert T.prune([ddp], m, need[ddp], margin)[0] == [ddp]
    assert T.prune([zero3], m, need[zero3] - 1, margin)[0] == []


# ---------------------------------------------------------------------- measuring and ranking
def _fake_runner(times, calls, fail=()):
    def run(c, rnd):
        calls.append((rnd, c.strategy))
        if c.strategy in fail:
            raise T.RunFailed("exit code 1: boom")
        return T.Measurement(times[c.strategy][rnd], [GiB * 0.5, GiB * 0.6], 4)
    return run


def test_runs_are_interleaved_and_the_slow_ones_dropped_after_round_one():
    cands = [T.Candidate(s, 16, 1, 1.0) for s in ("ddp", "zero1", "zero2", "zero3")]
    results = [T.Result(c, {"total": 0}) for c in cands]
    calls = []
    times = {"ddp": [1.0, 1.2, 1.1], "zero1": [1.05, 1.0, 1.0], "zero2": [2.0, 2, 2], "zero3": [0, 0, 0]}
    T.measure(results, _fake_runner(times, calls, fail=("zero3",)), repeats=3, keep_within=0.15)
    # round-robin, never back to back; zero2 (100% slower) and the failed zero3 leave after round 1
    assert calls == [(0, "ddp"), (0, "zero1"), (0, "zero2"), (0, "zero3"),
                     (1, "ddp"), (1, "zero1"), (2, "ddp"), (2, "zero1")]
    status = {r.candidate.strategy: r.status for r in results}
    assert status == {"ddp": "ok", "zero1": "ok", "zero2": "dropped", "zero3": "failed"}
    ranked = T.rank(results)
    assert [r.candidate.strategy for r in ranked] == ["zero1", "ddp", "zero2", "zero3"]
    assert ranked[0].step_s == 1.0 and ranked[1].step_s == pytest.approx(1.1)  # medians of the repeats
    assert T.winner(ranked).candidate.strategy == "zero1"
    table = T.format_table(ranked, tokens_per_step=4096, default=cands[0])
    assert "ddp mb16x1 b1MB (default)" in table and "0.500/0.600" in table and "failed: exit code 1" in table
    assert f"{4096 / 1.0:10.0f}" in table.splitlines()[1]  # tokens/s of the winner


def test_a_run_over_the_cap_cannot_win():
    fast, slow = T.Candidate("ddp", 16, 1, 25.0), T.Candidate("zero3", 16, 1, 5e7)
    results = [T.Result(fast, {"total": 0}, "ok", runs=[T.Measurement(1.0, [1.2 * GiB, GiB], 3)]),
               T.Result(slow, {"total": 0}, "ok", runs=[T.Measurement(2.0, [0.8 * GiB, 0.8 * GiB], 3)]),
               T.Result(T.Candidate("zero1", 16, 1, 5e6), {"total": 9 * GiB}, "pruned", "estimate")]
    T.apply_cap(results, 1.1 * GiB)
    assert results[0].status == "over cap" and "measured 1.200 GiB > cap 1.100 GiB" in results[0].why
    ranked = T.rank(results)
    assert T.winner(ranked).candidate == slow and ranked[-1].status == "pruned"
    assert T.winner(T.rank([results[0], results[2]])) is None


def test_read_run_leaves_out_the_warmup_steps(tmp_path):
    path = tmp_path / "resources.json"
    ranks = [[{"step": 5.0, "rss_peak": 1.0}, {"step": 1.0, "rss_peak": 3.0}, {"step": 2.0, "rss_peak": 3.0}],
             [{"step": 6.0, "rss_peak": 2.0}, {"step": 1.0, "rss_peak": 2.0}, {"step": 4.0, "rss_peak": 4.0}]]
    path.write_text(json.dumps({"ranks": ranks}))
    m = T.read_run(str(path), warmup=1)
    assert m.step_s == pytest.approx((1.5 + 2.5) / 2) and m.peak_rss == [3.0, 4.0] and m.steps == 2
    with pytest.raises(T.RunFailed, match="need more than the 3 warm-up step"):
        T.read_run(str(path), warmup=3)


# ---------------------------------------------------------------------- the tuned config
WINNER = ["model=gpt_tiny", "trainer.devices=2", "precision=bf16-mixed", "trainer.max_steps=7",
          *T.Candidate("zero2", 8, 2, 1_250_000).overrides()]


def test_tuned_config_composes_into_the_winners_config(tmp_path):
    from zerotrain import tune
    from zerotrain.train import normalize_overrides, validate

    overrides = normalize_overrides(WINNER)
    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / "best.yaml").write_text(tune.tuned_config(overrides, "test\nsecond line"))
    text = (tmp_path / "tuned" / "best.yaml").read_text()
    assert text.startswith("# @package _global_\n# test\n# second line\n")
    want = OmegaConf.to_container(tune.compose(overrides), resolve=True)
    # zerotrain-train's composition with nothing but the tuned config on its command line
    got = tune.compose(["+tuned=best", f"hydra.searchpath=[file://{tmp_path}]"])
    got = OmegaConf.to_container(got, resolve=True)
    got.pop("tuned", None)
    assert got == want
    assert got["strategy"]["name"] == "zero2" and got["strategy"]["reduce_bucket_size"] == 1_250_000
    assert got["data"]["batch_size"] == 8 and got["trainer"]["accumulate_grad_batches"] == 2
    assert got["precision"]["name"] == "bf16-mixed" and got["model"]["n_layer"] == 2
    cfg = OmegaConf.to_object(tune.compose(["+tuned=best", f"hydra.searchpath=[file://{tmp_path}]"]))
    validate(cfg)  # typed by the zero2 schema, and valid


# ---------------------------------------------------------------------- the chart
def _png_chunks(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks.append((kind, body))
        pos += 12 + n
    return chunks


@pytest.mark.parametrize("size", [(640, 480), (321, 200)])
def test_chart_is_a_valid_png_of_the_stated_size(tmp_path, size):
    w, h = size
    points = [Point(0.5, 120.0, "a"), Point(0.7, 100.0, "b", winner=True), Point(0.9, 130.0, "c")]
    path = tmp_path / "chart.png"
    write_png(str(path), _raster(points, w, h, x_line=0.8))  # the builtin renderer, matplotlib or not
    chunks = _png_chunks(path.read_bytes())
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    assert struct.unpack(">IIBBBBB", chunks[0][1]) == (w, h, 8, 2, 0, 0, 0)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == h * (1 + 3 * w) and all(raw[i * (1 + 3 * w)] == 0 for i in range(h))
    assert bytes((220, 30, 30)) in raw and bytes((40, 90, 200)) in raw  # the winner's ring, the dots
    renderer = scatter_png(str(tmp_path / "c2.png"), points, "x", "y", width=w, height=h)
    assert renderer in ("builtin", "matplotlib")
    assert struct.unpack(">II", (tmp_path / "c2.png").read_bytes()[16:24]) == (w, h)


def test_chart_with_one_point_or_none():
    assert len(_raster([Point(1.0, 1.0, winner=True)], 100, 80, None)) == 80
    assert len(_raster([], 100, 80, None)[0]) == 300


# ---------------------------------------------------------------------- the command, before any run
@pytest.mark.parametrize("argv,expected", [
    (["--strategies", "ddp,zero9"], "--strategies='zero9': is not a strategy the tuner searches"),
    (["--max-rss-gb", "-2"], "--max-rss-gb=-2.0: must be a finite number of GiB > 0"),
    (["--max-rss-gb", "inf"], "--max-rss-gb=inf"),
    (["--micro-batches", "3"], "--micro-batches=3: must divide the 16 samples"),
    (["--repeats", "0"], "--repeats=0: must be >= 1"),
    (["--name", "a/b"], "--name='a/b': must be a plain file name"),
    (["trainer.devices=two"], "trainer.devices"),
    (["strategy.nonsense=1"], "nonsense"),
    (["trainer.num_nodes=2"], "trainer.num_nodes=2: zerotrain-tune runs its trials on this machine"),
])
def test_bad_input_stops_before_any_process(tmp_path, capsys, argv, expected):
    from zerotrain import tune

    with pytest.raises(SystemExit) as info:
        tune.main(["--out", str(tmp_path / "out"), *argv, "model=gpt_tiny"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "zerotrain-tune: configuration error: " in err and expected in err, err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_space_and_the_pruning(tmp_path, capsys):
    from zerotrain import tune

    argv = ["--dry-run", "--out", str(tmp_path / "out"), "--strategies", "ddp,zero3", "--base-rss-gb", "0.25",
            "--max-rss-gb", "0.2", "model=gpt_tiny", "trainer.devices=2"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "12 configurations (ddp, zero3; global batch 32 = 16/rank x 2 ranks), 12 pruned" in out, out
    assert "cap 0.200 GiB per rank (--max-rss-gb)" in out and "ddp mb16x1 b25MB (default)" in out
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- any _target_ model
def test_the_demo_gpts_numbers_come_from_its_module_not_an_import_of_the_examples():
    """The tuner builds the module the config names (meta device) and counts its parameters; the
    GPT's ``activation_bytes`` method is the estimate: the same numbers as ``examples/gpt_cli.py``'s."""
    from zerotrain import tune
    from zerotrain.examples import gpt_cli as app

    with tune.hydra_context():
        plan = tune.Plan(tune.parse_args(["--strategies", "zero3", "model=gpt_tiny", "trainer.devices=2"]))
    model = plan.base.model
    assert plan.module.name == "GPTModule" and plan.memory.num_params == app.num_params(model)
    assert plan.memory.activation_bytes(4, True) == app.activation_bytes(model, 4, True, plan.base.precision.name)
    assert plan.tokens_per_step == plan.per_rank * 2 * model.block_size


def test_a_user_target_module_and_data_are_tuned(tmp_path, monkeypatch, capsys):
    """``model._target_`` / ``data._target_`` of the user's package: its parameters are counted, its
    missing activation hook is said, each trial sets ``data.batch_size`` as the DataModule's argument
    (checked against its signature), and the winner's tuned config composes back into its config."""
    from cli_user_package import DATA, MODEL, write_package
    from zerotrain import tune

    monkeypatch.syspath_prepend(str(write_package(tmp_path / "pkg")))
    line = [f"model._target_={MODEL}", "model.hidden=16", f"data._target_={DATA}", "data.batch_size=4",
            "trainer.devices=2"]
    argv = ["--dry-run", "--strategies", "ddp,zero2", "--bucket-scales", "1", "--base-rss-gb", "0.25", *line]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    params = (8 * 16 + 16) + (16 * 16 + 16) + (16 + 1)  # Regressor(hidden=16, depth=2)
    assert f"4 configurations (ddp, zero2; global batch 8 = 4/rank x 2 ranks), 0 pruned" in out, out
    assert f"Regressor: {params:,} params" in out and "activations not estimated" in out, out
    with tune.hydra_context():
        plan = tune.Plan(tune.parse_args(argv))
        c = next(r.candidate for r in plan.results if r.candidate.strategy == "zero2" and r.candidate.micro_batch == 2)
        assert "++data.batch_size=2" in plan.trial_overrides(c)
        (tmp_path / "tuned").mkdir()
        (tmp_path / "tuned" / "best.yaml").write_text(tune.tuned_config(plan.trial_overrides(c), "test"))
        got = OmegaConf.to_container(tune.compose(["+tuned=best", f"hydra.searchpath=[file://{tmp_path}]"]))
    assert got["model"] == {"_target_": MODEL, "hidden": 16} and got["data"] == {"_target_": DATA, "batch_size": 2}
    assert got["strategy"]["name"] == "zero2" and got["trainer"]["accumulate_grad_batches"] == 2
    # data.batch_size left out: the DataModule's default (Points: 4), which it is built with
    assert tune.main([a for a in argv if a != "data.batch_size=4"]) == 0
    assert "global batch 8 = 4/rank x 2 ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a key the DataModule does not take: one line, rc 2
        tune.main(["--dry-run", *line, "data.batch_sise=2"])
    assert exc.value.code == 2 and "data.batch_sise" in capsys.readouterr().err


def test_a_config_dir_of_the_users_own_is_taken_as_zerotrain_train_takes_it(tmp_path, monkeypatch, capsys):
    """``zerotrain-tune --config-dir DIR model=my_model data=my_data``: the user's own groups beside
    ours compose (every trial run of zerotrain-train gets the folder too, and so does the command
    that trains the winner); a folder that does not exist is one line, rc 2, before anything runs."""
    from cli_user_package import DATA, MODEL, write_package
    from zerotrain import tune
    from zerotrain.trainer.command.compose_check import check_compose

    monkeypatch.syspath_prepend(str(write_package(tmp_path / "pkg")))
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "data").mkdir()
    (conf / "model" / "my_model.yaml").write_text(f"_target_: {MODEL}\nhidden: 16\n")
    (conf / "data" / "my_data.yaml").write_text(f"_target_: {DATA}\nbatch_size: 4\n")
    argv = ["--dry-run", "--config-dir", str(conf), "--strategies", "ddp,zero2", "--bucket-scales", "1",
            "--base-rss-gb", "0.25", "model=my_model", "data=my_data", "trainer.devices=2"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 configurations (ddp, zero2; global batch 8 = 4/rank x 2 ranks), 0 pruned" in out, out
    assert "Regressor: " in out, out
    a = tune.parse_args(argv)
    a.overrides = tune.with_config_dir(a.config_dir, a.overrides)
    with tune.hydra_context():
        plan = tune.Plan(a)
        trial = plan.trial_overrides(plan.results[0].candidate)
        assert f"hydra.searchpath=[file://{conf}]" in trial
        got = OmegaConf.to_container(tune.compose(trial))
    assert got["model"] == {"_target_": MODEL, "hidden": 16}
    assert f"--config-dir {tmp_path / 'out'} 'hydra.searchpath=[file://{conf}]' +tuned=best" in \
        tune.train_command(a, str(tmp_path / "out"))
    check_compose(["--config-dir", str(conf), "model=my_model", "data=my_data"], "zerotrain.conf", "config")
    with pytest.raises(SystemExit) as info:
        tune.main(["--dry-run", "--config-dir", str(tmp_path / "nowhere"), "model=my_model"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--config-dir=" in err and "is not a directory" in err, err
