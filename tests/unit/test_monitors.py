"""The monitors of issue 16 on one process: the instrumentation hooks are inert with nothing
attached, the step timer's parts add up, the ``comms_logger`` option reaches the Trainer and the
CLI, the ResourceMonitor's rows reach the loggers, and the FlopsProfiler's count of the demo GPT
is 6 N tokens + attention (the PaLM estimate, ``GPT.flops_per_token``) within 2%. The
multi-process checks (breakdown on ddp/zero2/zero3, bytes against the formula) are in
``tests/distributed/test_monitors.py``."""
from __future__ import annotations

import time

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from zerotrain import Callback, Trainer
from zerotrain.callbacks import CommsLogger, FlopsProfiler, ResourceMonitor
from zerotrain.callbacks.base import Logger
from zerotrain.callbacks.measure.comms import bus_factor
from zerotrain.callbacks.measure.resources import PARTS, StepTimer
from zerotrain.examples.data import stdlib_corpus
from zerotrain.examples.gpt import GPTConfig
from zerotrain.examples.gpt_cli import SIZES
from zerotrain.examples.gpt_module import GPTModule
from zerotrain.strategies import instrument
from zerotrain.strategies.ddp import DDPConfig
from zerotrain.strategies.zero import ZeroStage2, ZeroStage3


def test_hooks_are_inert_without_a_listener():
    assert not instrument.active()
    work = object()
    assert instrument.issued("all_reduce", work, None, torch.zeros(3)) is work
    assert instrument.wait_begin() is None
    instrument.phase("training_step")
    instrument.wait_end(None)
    with instrument.section("checkpoint"), instrument.blocking("all_reduce", torch.zeros(1)):
        pass


def test_step_timer_parts_add_up_and_blocked_time_moves_to_comm_wait():
    timer = StepTimer()
    timer.phase("training_step")
    time.sleep(0.02)
    timer.blocked(0.01)
    timer.blocked(10.0)  # more than the stretch holds: capped at what is left of it
    timer.phase("fetching the next training batch")
    prev = timer.enter("checkpoint")
    assert prev == "data"
    timer.enter(prev)
    parts, start, end = timer.close()
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == pytest.approx(end - start, abs=1e-12)
    assert parts["comm_wait"] >= 0.01 and parts["forward"] >= 0
    assert parts["forward"] + parts["comm_wait"] >= 0.02


def test_bus_factors_are_nccl_tests_conventions():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("broadcast", 4) == 1.0


def test_comms_logger_option_adds_the_callback():
    with_option = Trainer(strategy=ZeroStage2(comms_logger=True), logger=False, enable_progress_bar=False)
    assert sum(isinstance(c, CommsLogger) for c in with_option.callbacks) == 1
    given = CommsLogger()
    both = Trainer(strategy=ZeroStage3(comms_logger=True), callbacks=[given], logger=False)
    assert [c for c in both.callbacks if isinstance(c, CommsLogger)] == [given]
    assert not any(isinstance(c, CommsLogger) for c in Trainer(strategy="zero2", logger=False).callbacks)
    with pytest.raises(TypeError, match="comms_logger"):
        DDPConfig(comms_logger="yes")


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3", "offload", "pipeline"])
def test_cli_strategy_schemas_have_comms_logger(name):
    from zerotrain.trainer.command.config import strategy_schema

    assert strategy_schema(name)().comms_logger is False


def test_cli_turns_the_resource_monitor_on_by_default(tmp_path):
    from zerotrain.train import build

    def callbacks(*overrides):
        with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
            cfg = OmegaConf.to_object(compose(config_name="config", overrides=[
                "model=gpt_tiny", "trainer.devices=1", f"trainer.default_root_dir={tmp_path}", *overrides]))
        return [type(c).__name__ for c in build(cfg)[0].callbacks]

    assert "ResourceMonitor" in callbacks() and "FlopsProfiler" not in callbacks()
    assert "ResourceMonitor" not in callbacks("callbacks.resources=false")
    assert "FlopsProfiler" in callbacks("callbacks.flops_profile_step=3")
    assert any(c == "CommsLogger" for c in callbacks("strategy.comms_logger=true"))


class _Rows(Logger):
    def __init__(self):
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))


def _module(tmp_path, size: dict, batch_size: int, steps: int) -> GPTModule:
    path = tmp_path / "corpus.txt"
    path.write_bytes(stdlib_corpus(60_000))
    return GPTModule(GPTConfig(**size), batch_size=batch_size, data_path=str(path), max_bytes=60_000,
                     max_steps=steps, warmup_steps=1, val_fraction=0)


def test_resource_monitor_rows_reach_the_loggers_and_the_summary(tmp_path):
    torch.manual_seed(0)
    rows, monitor = _Rows(), ResourceMonitor(log_every_n_steps=1, print_summary=False)
    trainer = Trainer(max_steps=3, callbacks=[monitor], logger=rows, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_module(tmp_path, SIZES["gpt_tiny"], 2, 3))
    assert not instrument.active()  # detached at the end of fit
    timed = [r for r in rows.rows if "time/forward" in r]
    assert len(timed) == 3
    assert {f"time/{p}" for p in PARTS} | {"time/step", "memory/rss_peak_gb"} <= set(timed[0])
    for r in timed:
        assert sum(r[f"time/{p}"] for p in PARTS) == pytest.approx(r["time/step"], rel=1e-9)
    table = monitor.summary["rows"]
    assert table["step"]["share"] == pytest.approx(1.0) and table["forward"]["mean"] > 0
    assert monitor.summary["memory"]["rss_peak"] > 0


def test_resource_monitor_writes_every_step_as_json(tmp_path):
    """``json_path`` (the CLI's ``callbacks.resources_json``, what zerotrain-tune reads): every
    step, warm-up included, per rank."""
    import json

    path = tmp_path / "sub" / "resources.json"
    monitor = ResourceMonitor(print_summary=False, json_path=str(path))
    trainer = Trainer(max_steps=3, callbacks=[monitor], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_module(tmp_path, SIZES["gpt_tiny"], 2, 3))
    ranks = json.loads(path.read_text())["ranks"]
    assert len(ranks) == 1 and len(ranks[0]) == 3 and ranks[0] == monitor.steps
    assert {"step", "rss_peak", *PARTS} <= set(ranks[0][0]) and not (tmp_path / "sub" / "resources.json.tmp").exists()


def test_resource_monitor_refuses_a_json_path_it_could_not_write_before_training():
    with pytest.raises(ValueError, match=r"json_path='/proc/zt.json': its directory is under /proc"):
        ResourceMonitor(json_path="/proc/zt.json")


def test_resource_monitor_counts_the_nvme_swap_io_of_each_step(tmp_path):
    """NVMe offload: every step reads each sub-group's state from its swap file and writes it back
    before the step ends, so each step's ``io_read`` and ``io_written`` are the swap files' size;
    over the fit they are what the swapper itself counted; the time blocked on that I/O is the
    ``io_wait`` part (the parts still add up to the step) and ``io_busy`` the time a read or write ran."""
    from zerotrain.strategies.offload import Offload

    torch.manual_seed(0)
    rows, monitor = _Rows(), ResourceMonitor(log_every_n_steps=1, print_summary=True)
    strategy = Offload(stage=2, optimizer_device="nvme", nvme_path=str(tmp_path / "nvme"), sub_group_size=20_000)
    trainer = Trainer(strategy=strategy, max_steps=3, callbacks=[monitor], logger=rows, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    before = {}

    class Counter(Callback):  # the swapper's own count when training starts
        def on_train_start(self, trainer, module):
            rep = trainer.strategy.stepper.report(trainer.strategy.sharded, 2)
            before.update(read=rep["bytes_read"], written=rep["bytes_written"])

    trainer.callbacks.append(Counter())
    trainer.fit(_module(tmp_path, SIZES["gpt_tiny"], 2, 3))
    rep = trainer.strategy.stepper.report(trainer.strategy.sharded, 2)
    assert rep["disk_bytes"] > 0 and rep["subgroups"] > 1
    for r in monitor.steps:
        assert r["io_read"] == r["io_written"] == rep["disk_bytes"]
        assert 0 < r["io_busy"] and 0 <= r["io_wait"] <= r["step"]
        assert sum(r[p] for p in PARTS) == pytest.approx(r["step"], rel=1e-9)
    assert sum(r["io_read"] for r in monitor.steps) == rep["bytes_read"] - before["read"]
    assert sum(r["io_written"] for r in monitor.steps) == rep["bytes_written"] - before["written"]
    logged = [r for r in rows.rows if "io/read_gb" in r]
    assert len(logged) == 3 and logged[0]["io/read_gb"] == pytest.approx(rep["disk_bytes"] / 1e9)
    assert logged[0]["io/gb_per_s"] > 0 and "time/io_wait" in logged[0]


def test_flops_of_the_demo_gpt_are_6n_tokens_plus_attention(tmp_path):
    """gpt_small, the demo's model: FLOPs of one training step (forward and backward) of
    ``batch_size`` full-context samples against ``GPT.flops_per_token`` x tokens."""
    torch.manual_seed(0)
    profiler = FlopsProfiler(profile_step=0, print_profile=False)
    trainer = Trainer(max_steps=2, callbacks=[profiler], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    size = SIZES["gpt_small"]
    module = _module(tmp_path, size, 2, 2)
    trainer.fit(module)
    prof = profiler.profile
    expected = module.flops_per_sample() * 2
    assert prof["total_flops"] == pytest.approx(expected, rel=0.02)
    mods = prof["modules"]
    blocks = sum(mods[f"model.blocks.{i}"]["flops"] for i in range(size["n_layer"]))
    assert blocks + mods["model.lm_head"]["flops"] == prof["total_flops"]  # every FLOP in a module
    assert mods["model.blocks.0"]["params"] == sum(p.numel() for p in module.model.blocks[0].parameters())
    assert prof["latency_timed_without_counter"] and prof["latency_s"] > 0
    assert prof["peak_flops"] > 0 and 0 < prof["mfu"]
