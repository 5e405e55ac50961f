"""The ResourceMonitor and the CommsLogger on the demo GPT (tiny) trained by the real Trainer on
real gloo processes (issue 16).

* The breakdown adds up: the parts of every step sum to the step's wall time by construction
  (every moment between two step ends is in exactly one part), checked exactly; the steps' sum
  is also checked against independent clock readings, taken by another callback at each step
  end, within 5% over the run (first to last step end: per step, a moment descheduled between
  the two readings moves a short step by more on a loaded machine), and the unattributed 'other'
  part must stay a minority. No assertion on speed.
* The comms logger's bytes per step equal the formula (``callbacks/measure/comms.py``) for ddp, zero1,
  zero2 and zero3, on 2 ranks and (one case by default, the rest ``slow``) on 4.
* Attaching the monitors changes no number (DDP is the one strategy whose path they change: its
  buckets go through a comm hook): the trained weights are bitwise those of an unmonitored run.
"""
from __future__ import annotations

import pytest
import torch

from harness import run_ranks

STEPS = 5
BREAKDOWN_STEPS = 8  # ~0.4 s between the first and last step ends on an idle 2-core machine


def _corpus(tmp_path) -> str:
    from zerotrain.examples.data import stdlib_corpus

    path = tmp_path / "corpus.txt"
    path.write_bytes(stdlib_corpus(40_000))
    return str(path)


def _fit(strategy: str, corpus: str, monitored: bool = True, accumulate: int = 1, clip: float | None = None,
         options: dict | None = None, width: int = 32, steps: int = STEPS) -> dict:
    import os
    import time

    from zerotrain import Callback, Trainer
    from zerotrain.callbacks import CommsLogger, ResourceMonitor
    from zerotrain.examples.gpt import GPTConfig
    from zerotrain.examples.gpt_module import GPTModule
    from zerotrain.strategies import strategy_from_name

    class Stamps(Callback):
        """Reads the clock at each step end, apart from the monitor (it runs after it)."""

        def __init__(self):
            self.times = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                self.times.append(time.perf_counter())

    torch.manual_seed(0)
    config = GPTConfig(block_size=width // 2, n_layer=2, n_head=2, n_embd=width)
    module = GPTModule(config, batch_size=width // 8, data_path=corpus, max_bytes=40_000, max_steps=steps,
                       warmup_steps=1, val_fraction=0)
    monitor, comms, stamps = ResourceMonitor(print_summary=False), CommsLogger(), Stamps()
    callbacks = [monitor, comms, stamps] if monitored else []
    trainer = Trainer(strategy=strategy_from_name(strategy, **(options or {})), devices=int(os.environ["WORLD_SIZE"]),
                      accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                      callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, seed=0)
    trainer.fit(module)
    full = trainer.full_state_dict()  # collective; {} off rank 0
    weights = torch.cat([v.reshape(-1).float() for v in full.values()]) if full else torch.zeros(0)
    if not monitored:
        return {"weights": weights}
    return {"weights": weights, "steps": monitor.steps, "stamps": stamps.times,
            "step_bytes": {int(k): v for k, v in comms.step_bytes.items()}, "expected": comms.expected,
            "expected_first": comms.expected_first,
            "control": {r["op"] for r in comms.summary if r["op"].endswith(" (control)")},
            "table": {k: v["share"] for k, v in monitor.summary["rows"].items()}}


def _check_breakdown(out: dict) -> None:
    steps, stamps = out["steps"], out["stamps"]
    assert len(steps) == len(stamps) == BREAKDOWN_STEPS
    parts = ("data", "forward", "backward", "comm_wait", "optimizer", "refresh", "checkpoint", "validation", "other")
    for i, s in enumerate(steps):
        assert all(s[p] >= 0 for p in parts), s
        assert sum(s[p] for p in parts) == pytest.approx(s["step"], rel=1e-9, abs=1e-9)  # by construction
        assert s["forward"] > 0 and s["backward"] > 0 and s["optimizer"] > 0, s
        assert s["rss_peak"] > 0
        assert s["other"] < 0.5 * s["step"], s
    # against the other clock's readings, from the first step end to the last: a descheduled
    # moment between the monitor's reading and the other one shifts a single short step by
    # several percent on a loaded machine, the whole run by much less
    wall = stamps[-1] - stamps[0]
    assert sum(s["step"] for s in steps[1:]) == pytest.approx(wall, rel=0.05)
    assert out["table"]["step"] == pytest.approx(1.0)


def _check_bytes(out: dict) -> None:
    assert out["expected"], "no formula for this strategy"
    assert sorted(out["step_bytes"]) == list(range(len(out["steps"])))
    for step, by_op in out["step_bytes"].items():
        want = out["expected_first"] if step == 0 else out["expected"]
        assert by_op == want, (step, by_op, want)
    # the loop's own collectives (the per-step stop-signal agreement) are logged
    # too, apart from the model's traffic the formula counts
    assert "all_reduce (control)" in out["control"], out["control"]


CASES = {"ddp": {}, "zero1": {}, "zero2": {}, "zero3": {}}  # zero3: "auto" keeps every block


@pytest.mark.parametrize("strategy", sorted(CASES))
def test_breakdown_adds_up_and_bytes_match_the_formula_on_2_ranks(tmp_path, strategy):
    results = run_ranks("test_monitors:_fit", 2, tmp_path, timeout=180, strategy=strategy,
                        corpus=_corpus(tmp_path), clip=1.0, width=96, steps=BREAKDOWN_STEPS)
    for out in results:
        _check_breakdown(out)
        _check_bytes(out)
    if strategy != "ddp":
        assert any(s["comm_wait"] > 0 for s in results[0]["steps"])
    if strategy == "zero3":  # the default reuse distance: the blocks are gathered once per step
        assert results[0]["expected"]["all_gather"] < results[0]["expected_first"]["all_gather"]


@pytest.mark.parametrize("strategy,accumulate,options", [
    ("zero2", 2, {"reduce_mode": "reduce_scatter"}),
    ("zero3", 2, {"reshard_after_forward": False, "reduce_mode": "reduce_scatter"}),
    ("zero1", 2, {}),
])
def test_bytes_match_the_formula_with_accumulation_and_other_modes(tmp_path, strategy, accumulate, options):
    results = run_ranks("test_monitors:_fit", 2, tmp_path, timeout=180, strategy=strategy,
                        corpus=_corpus(tmp_path), accumulate=accumulate, options=options)
    for out in results:
        _check_bytes(out)


@pytest.mark.parametrize("strategy", [
    "zero3", pytest.param("ddp", marks=pytest.mark.slow), pytest.param("zero1", marks=pytest.mark.slow),
    pytest.param("zero2", marks=pytest.mark.slow)])
def test_bytes_match_the_formula_on_4_ranks(tmp_path, strategy):
    results = run_ranks("test_monitors:_fit", 4, tmp_path, timeout=300, strategy=strategy,
                        corpus=_corpus(tmp_path))
    for out in results:
        _check_bytes(out)
        assert len(out["steps"]) == STEPS


@pytest.mark.slow
def test_monitoring_changes_no_number_under_ddp(tmp_path):
    corpus = _corpus(tmp_path)
    seen = run_ranks("test_monitors:_fit", 2, tmp_path / "a", timeout=180, strategy="ddp", corpus=corpus)
    plain = run_ranks("test_monitors:_fit", 2, tmp_path / "b", timeout=180, strategy="ddp", corpus=corpus,
                      monitored=False)
    assert seen[0]["weights"].numel() > 0
    assert torch.equal(seen[0]["weights"], plain[0]["weights"])


def _deepspeed_engine_steps(stage: int) -> dict:
    """A DeepSpeed-style loop (``zerotrain.deepspeed``) with ``comms_logger`` enabled in its config:
    what ``deepspeed.comm.log_summary`` reports."""
    import contextlib
    import io

    import zerotrain.deepspeed as deepspeed
    from zerotrain.callbacks.measure.comms import bytes_per_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "comms_logger": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(3 * 2):
        loss = engine(torch.randn(4, 8, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = deepspeed.comm.log_summary(return_dict=True)["summary"]
    recorder = deepspeed.comm._recording[0]
    from zerotrain.callbacks.measure.comms import expected_step_bytes
    from zerotrain.trainer.compat.deepspeed.ops import zero_clip
    loop = type("Loop", (), {"accumulate_grad_batches": 2, "gradient_clip_val": None})
    expected = expected_step_bytes(engine._zt.strategy, loop)
    # the clip is DeepSpeed's (ops/zero_clip.py): one fp64 sum of squares per norm group and rank
    expected["all_reduce"] = expected.get("all_reduce", 0) + zero_clip.norm_bytes(engine)
    out = {"steps": bytes_per_step([e for e in recorder.events if e.step < 3]), "printed": printed.getvalue(),
           "expected": expected, "rows": len(summary), "clip_bytes": zero_clip.norm_bytes(engine)}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_config_comms_logger_reports_each_step_beside_the_formula(tmp_path, stage):
    for rank, out in enumerate(run_ranks("test_monitors:_deepspeed_engine_steps", 2, tmp_path, timeout=120,
                                         stage=stage)):
        assert out["expected"] and sorted(out["steps"]) == [0, 1, 2]
        assert all(by_op == out["expected"] for by_op in out["steps"].values()), out
        assert ("formula:" in out["printed"]) == (rank == 0) and out["rows"] > 0
        assert out["clip_bytes"] == 8 * 2  # one norm group (one param group; stage 3: one sub-group) x 2 ranks
