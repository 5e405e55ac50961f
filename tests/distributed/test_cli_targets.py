"""``zerotrain-train`` with the user's own TrainModule and DataModule on 2 processes, the package
written into a temporary folder outside the repository (tests/cli_user_package.py):

* under ddp, zero2 and zero3, from the command line with overrides (``model.hidden=6
  model.lr=0.05 data.batch_size=4``): every step's loss equals the same module and data trained
  through ``Trainer.fit`` in Python with the same Trainer arguments, exactly (the same code runs);
* a ``--multirun`` sweep over 2 strategies x 2 learning rates: each job a 2-process run in its own
  folder, the table at the end (one row per job: strategy, lr, final loss), the jobs of one lr equal
  across the strategies (the first job's weights are drawn as every later job's);
* a Hugging Face Llama (``model=llama_tiny``: a LlamaConfig of 2 layers, tiny dims) under zero3:
  trains, checkpoints (with the composed config beside the checkpoints), resumes and samples.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_user_package import DATA, MODEL, read_losses, run_cli, write_package
from harness import run_ranks

STEPS = 5
QUIET = ["callbacks.tensorboard=false", "callbacks.throughput=false", "callbacks.resources=false",
         "trainer.enable_progress_bar=false", "sample_tokens=0"]
#: the CLI's Trainer arguments that differ from the Trainer's defaults, set as the Python run sets them
TRAINER = {"max_steps": STEPS, "gradient_clip_val": None, "val_check_interval": 1.0, "log_every_n_steps": 1,
           "seed": 0}


def fit_in_python(pkg_root: str, strategy: str, record: str) -> list[float]:
    """A rank of the Python run: the same module and data through ``Trainer.fit``."""
    import sys

    sys.path.insert(0, pkg_root)
    from userpkg.models import Points, Regressor

    from zerotrain import Trainer
    from zerotrain.trainer.utilities import seed_rngs

    seed_rngs(0)  # as zerotrain-train does before it builds the module (trainer.seed)
    module = Regressor(hidden=6, lr=0.05, record=record)
    trainer = Trainer(strategy=strategy, devices=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, **TRAINER)
    trainer.fit(module, datamodule=Points(batch_size=4))
    return module.losses


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", *(pytest.param(s, marks=pytest.mark.slow) for s in ("zero2", "zero3"))])
def test_user_module_from_the_command_line_equals_trainer_fit(tmp_path, strategy):
    root = write_package(tmp_path / "pkg")
    record = tmp_path / "cli_losses.json"
    proc = run_cli(root, tmp_path, f"model._target_={MODEL}", "model.hidden=6", "model.lr=0.05",
                   f"model.record={record}", f"data._target_={DATA}", "data.batch_size=4", f"strategy={strategy}",
                   "trainer.devices=2", f"trainer.max_steps={STEPS}", "trainer.gradient_clip_val=null",
                   "trainer.val_check_interval=1.0", "trainer.log_every_n_steps=1", *QUIET,
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    cli = read_losses(record)
    python = run_ranks(f"{__name__}:fit_in_python", 2, tmp_path / "python", timeout=300,
                       pkg_root=str(root), strategy=strategy, record="")[0]
    # tolerance: exact: the same module, seed, data and strategy, only the entry point differs
    assert len(cli) == STEPS and cli == python, (cli, python)
    saved = (tmp_path / "run" / "checkpoints" / "config.yaml").read_text()
    assert f"_target_: {MODEL}" in saved and "hidden: 6" in saved and f"name: {strategy}" in saved


@pytest.mark.timeout(900)
@pytest.mark.slow  # ~21 s alone: keeps the default suite under its 15 minutes
def test_multirun_over_strategies_and_learning_rates_ends_with_its_table(tmp_path):
    root = write_package(tmp_path / "pkg")
    proc = run_cli(root, tmp_path, "--multirun", f"model._target_={MODEL}", "model.hidden=6", "model.lr=0.05,0.1",
                   f"data._target_={DATA}", "strategy=ddp,zero2", "trainer.devices=2", "trainer.max_steps=3",
                   "trainer.val_check_interval=1.0", *QUIET, f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    table = proc.stdout[proc.stdout.index("sweep: 4 job(s)"):].splitlines()[1:7]
    header = [c.strip() for c in table[0].split("|")[1:-1]]
    assert header[:5] == ["job", "model.lr", "strategy", "status", "train_loss"], table
    rows = [dict(zip(header, (c.strip() for c in line.split("|")[1:-1]))) for line in table[2:]]
    assert [(r["model.lr"], r["strategy"], r["status"]) for r in rows] == [
        ("0.05", "ddp", "ok"), ("0.05", "zero2", "ok"), ("0.1", "ddp", "ok"), ("0.1", "zero2", "ok")], table
    loss = {(r["model.lr"], r["strategy"]): float(r["train_loss"]) for r in rows}
    # 4 decimals printed: ddp and zero2 reduce the same gradients (fp32 rounding far below that)
    # tolerance: the 4 printed decimals: ddp and zero2 differ by fp32 reduction order at most, far below 1e-4
    assert loss["0.05", "ddp"] == loss["0.05", "zero2"] and loss["0.1", "ddp"] == loss["0.1", "zero2"], loss
    assert loss["0.05", "ddp"] != loss["0.1", "ddp"]
    sweep = tmp_path / "sweep"
    assert (sweep / "sweep_table.md").read_text().strip() == "\n".join(table).strip()
    for job in range(4):
        assert (sweep / str(job) / "checkpoints" / "config.yaml").exists()


@pytest.mark.timeout(900)
@pytest.mark.slow  # ~36 s on an AVX2 EPYC: keeps the default suite near its 15 minutes
def test_a_small_llama_under_zero3_trains_checkpoints_resumes_and_samples(tmp_path):
    pytest.importorskip("transformers")
    run = tmp_path / "run"
    common = ["model=llama_tiny", "data=lm_text", "data.max_bytes=40000", "strategy=zero3", "trainer.devices=2",
              "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "callbacks.checkpoint_every_n_steps=2",
              "callbacks.tensorboard=false", "callbacks.throughput=false", "trainer.enable_progress_bar=false",
              f"hydra.run.dir={run}"]
    first = run_cli(Path(tmp_path), tmp_path, *common, "trainer.max_steps=4", "sample_tokens=0", timeout=400)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "done: 4 steps" in first.stdout, first.stdout[-3000:]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "step=000004.ckpt").is_dir()
    saved = (checkpoints / "config.yaml").read_text()
    assert "_target_: transformers.LlamaConfig" in saved and "num_hidden_layers: 2" in saved, saved
    second = run_cli(Path(tmp_path), tmp_path, *common, "trainer.max_steps=6", "ckpt_path=latest", "sample_tokens=12",
                     timeout=400)
    assert second.returncode == 0, second.stderr[-5000:]
    out = second.stdout
    # resumed at step 4: this run made steps 5 and 6 only (the monitor's first step is its warm-up)
    assert re.search(r"ResourceMonitor: step time per rank over 1 step\(s\) on 2 rank\(s\)", out), out[-3000:]
    assert "done: 6 steps" in out and (checkpoints / "step=000006.ckpt").is_dir()
    sample = out[out.index("----- sample -----") + 19:out.index("------------------", out.index("----- sample"))]
    assert sample.startswith("def ") and len(sample.rstrip("\n")) > len("def "), repr(sample)
    val = float(re.search(r"val_loss (\S+);", out).group(1))
    assert 0 < val < 6  # below log(256): it learned
