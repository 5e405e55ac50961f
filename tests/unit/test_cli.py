"""The CLI rejects bad values with a clear message and a non-zero exit before any process starts,
and a good command line composes into the objects it names."""
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

BAD = [
    ("strategy=zero9", ["Could not find 'strategy/zero9'", "Available options in 'strategy'", "ddp"]),
    ("precision=fp8", ["Could not find 'precision/fp8'", "bf16-mixed"]),
    ("trainer.devices=-1", ["devices=-1", ">= 1"]),
    ("trainer.max_step=5", ["Key 'max_step' not in 'TrainerConfig'"]),
    ("trainer.devices=two", ["trainer.devices", "two"]),
    ("data.path=/no/such/file.txt", ["data.path='/no/such/file.txt' is not a file"]),
    ("strategy.bucket_cap_mb=-1", ["bucket_cap_mb=-1.0 must be > 0"]),
    ("model.n_embd=30", ["n_embd", "30"]),
]


@pytest.mark.parametrize("override,expected", BAD, ids=[b[0] for b in BAD])
def test_cli_rejects_bad_values_before_launch(tmp_path, override, expected):
    proc = subprocess.run([sys.executable, "-m", "zerotrain.train", override, f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "step/s" not in proc.stderr and "done:" not in proc.stdout  # the loop (and the other ranks) never started
    assert not (tmp_path / "checkpoints").exists()


def test_good_overrides_compose_into_objects(tmp_path):
    from zerotrain.train import build
    from zerotrain.trainer.config import Config

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        dcfg = compose(config_name="config", overrides=["strategy=ddp", "precision=16-mixed",
                                                        "precision.init_scale=128", "trainer.devices=2",
                                                        "trainer.max_steps=50", "model=gpt_tiny",
                                                        f"trainer.default_root_dir={tmp_path}"])
    cfg = OmegaConf.to_object(dcfg)
    assert isinstance(cfg, Config)
    trainer, module = build(cfg)
    assert trainer.strategy.name == "ddp" and trainer.devices == 2 and trainer.max_steps == 50
    assert trainer.precision_plugin.loss_scale == 128
    assert module.config.n_layer == 2


def test_two_process_cli_run_shares_one_hydra_output_dir(tmp_path):
    """The demo path end to end: rank 0 re-launches rank 1 with rank 0's Hydra run directory."""
    proc = subprocess.run([sys.executable, "-m", "zerotrain.train", "trainer.devices=2", "model=gpt_tiny",
                           "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
                           "data.max_bytes=100000", "sample_tokens=8", "trainer.enable_progress_bar=false"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    assert proc.stdout.count("----- sample -----") == 1  # printed by rank 0 only
    metas = list((run_dirs[0] / "checkpoints").rglob("meta.pt"))
    assert len(metas) == 1, metas  # one checkpoint, written by both ranks together
    assert sorted(p.stem for p in metas[0].parent.iterdir() if p.name.startswith("rank_")) == ["rank_00000",
                                                                                               "rank_00001"]
    assert any((run_dirs[0] / "tensorboard").rglob("events.out.tfevents*"))
