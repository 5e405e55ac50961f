"""``zerotrain-train`` with the user's own TrainModule / DataModule (``model._target_``,
``data._target_``; ``trainer/command/hydra_target.py``): the command line's rewriting, the checks of the
keys against the target's signature (rc 2, one line, before any process starts), the Hugging Face
module's build, the sweep table, and that ``train.py`` no longer imports ``examples/``.
The runs on 2 processes are in tests/distributed/test_cli_targets.py."""
from __future__ import annotations

import ast
import pathlib

import pytest

from cli_user_package import DATA, MODEL, run_cli, write_package

ROOT = pathlib.Path(__file__).resolve().parents[2]
TYPED = {"model": ("gpt_tiny", "gpt_small"), "data": ("stdlib", "text")}


# ---------------------------------------------------------------------- the command line's rewriting
def test_a_target_override_selects_the_empty_option_and_its_keys_need_no_plus():
    from zerotrain.trainer.command.hydra_target import target_overrides

    out = target_overrides(["model._target_=p.M", "model.hidden=4", "+model.x=1", "~model.y", "trainer.devices=2",
                            "data.batch_size=3"], TYPED)
    assert out == ["++model._target_=p.M", "++model.hidden=4", "++model.x=1", "~model.y", "trainer.devices=2",
                   "data.batch_size=3", "model=target"]
    assert target_overrides(out, TYPED) == out  # the other ranks re-run the rewritten command line


def test_typed_options_are_left_to_hydra():
    from zerotrain.trainer.command.hydra_target import target_overrides

    line = ["model=gpt_tiny", "model.n_layer=3", "data.batch_size=2", "--multirun"]
    assert target_overrides(line, TYPED) == line
    assert target_overrides(["model=mine", "model.a=1"], TYPED) == ["model=mine", "++model.a=1"]  # a user group


# ---------------------------------------------------------------------- the checks, in-process
def _user_module(tmp_path):
    import importlib
    import sys

    write_package(tmp_path)
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return sys


@pytest.mark.parametrize("keys,expected", [
    ({"hidden": "abc"}, "model.hidden='abc': Expected a <class 'int'>. Got value: abc; valid: hidden: int, "
                        "as userpkg.models.Regressor takes it"),
    ({"lr": 0.5}, "model.hidden: missing, a required argument of userpkg.models.Regressor; valid: "
                  "model.hidden=<value> (hidden: int)"),
    ({"hidden": 4, "hiden": 5}, "model.hiden=5: userpkg.models.Regressor takes no argument 'hiden'; did you mean "
                                "model.hidden?; valid keys: depth, hidden, lr, record"),
    ({"hidden": 4, "lr": "fast"}, "model.lr='fast': Expected a <class 'float'>. Got value: fast; valid: "
                                  "lr: float = 0.1, as userpkg.models.Regressor takes it"),
])
def test_keys_are_checked_against_the_signature(tmp_path, keys, expected):
    from zerotrain.trainer.errors import ConfigError
    from zerotrain.trainer.command.hydra_target import check_target

    sys = _user_module(tmp_path)
    try:
        with pytest.raises(ConfigError) as info:
            check_target("model", {"_target_": MODEL, **keys})
        assert str(info.value) == expected
        check_target("model", {"_target_": MODEL, "hidden": 4, "lr": 1})  # an int is a float
    finally:
        sys.path.remove(str(tmp_path))


def test_an_import_that_fails_names_the_target():
    from zerotrain.trainer.errors import ConfigError
    from zerotrain.trainer.command.hydra_target import check_target

    with pytest.raises(ConfigError, match=r"^model\._target_='nopkg\.M': cannot be imported \("):
        check_target("model", {"_target_": "nopkg.M"})


def test_nested_targets_are_checked_and_the_hf_module_builds_its_model_in_configure_model():
    """conf/model/llama_tiny.yaml: Hydra builds the LlamaConfig and a partial of
    AutoModelForCausalLM.from_config; the network exists only after configure_model (so zero3
    builds it partitioned)."""
    pytest.importorskip("transformers")
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import zerotrain.train as train
    from zerotrain.trainer.command.causal_lm import CausalLMModule

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=train.target_overrides(
            ["model=llama_tiny", "data=lm_text", "model.model.config.num_hidden_layers=1", "trainer.devices=1"],
            train.TYPED_OPTIONS)))
    train.validate(cfg)
    module = train.build_module(cfg)
    assert isinstance(module, CausalLMModule) and module.net is None
    module.configure_model()
    assert module.net.config.num_hidden_layers == 1 and module.net.config.vocab_size == 256
    data = train.build_datamodule(cfg)
    data.setup("fit")
    x, y = data._train[0]
    assert x.shape == (64,) and (x[1:] == y[:-1]).all()


# ---------------------------------------------------------------------- refused before any process starts
@pytest.mark.timeout(300)
@pytest.mark.parametrize("override,start", [
    ("model.hidden=abc", "model.hidden='abc': Expected a <class 'int'>"),
    (None, "model.hidden: missing, a required argument of userpkg.models.Regressor"),
    ("model.hidn=4", "model.hidn=4: userpkg.models.Regressor takes no argument 'hidn'; did you mean model.hidden?"),
    ("data.batch_size=x", "data.batch_size='x': Expected a <class 'int'>"),
], ids=["bad-type", "missing", "unknown-key", "bad-data-type"])
def test_the_command_line_refuses_bad_user_arguments_with_rc_2(tmp_path, override, start):
    root = write_package(tmp_path / "pkg")
    args = [f"model._target_={MODEL}", f"data._target_={DATA}", "trainer.devices=2", f"hydra.run.dir={tmp_path}/run"]
    if override != "model.hidden=abc" and override is not None:
        args.append("model.hidden=4")
    args += [override] if override else []
    proc = run_cli(root, tmp_path, *args, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("zerotrain-train: configuration error: " + start), lines
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing started


# ---------------------------------------------------------------------- the sweep's table
def test_the_sweep_table_has_a_column_per_swept_key():
    from zerotrain.trainer.command.sweep_table import format_table

    rows = [{"overrides": ["++model.lr=0.1", "strategy=ddp", "trainer.devices=2"], "status": "ok", "train_loss": 1.5,
             "steps": 3, "step_ms": 12.25, "peak_gib": 0.3},
            {"overrides": ["++model.lr=0.2", "strategy=zero2", "trainer.devices=2"], "status": "failed: ValueError"}]
    lines = format_table(rows).splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["job", "model.lr", "strategy", "status", "train_loss",
                                                              "steps", "step_ms", "peak_gib"]
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["0", "0.1", "ddp", "ok", "1.5000", "3", "12.2", "0.3"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]][:4] == ["1", "0.2", "zero2", "failed: ValueError"]


def test_a_multirun_jobs_ranks_rerun_that_job_only(monkeypatch):
    """The launcher's command line for the other ranks of a ``--multirun`` job: the sweep's options
    without ``--multirun``, and the job's own overrides (not the sweep's)."""
    from types import SimpleNamespace

    from hydra.types import RunMode

    from zerotrain.trainer.launch import launcher

    hc = SimpleNamespace(mode=RunMode.MULTIRUN, overrides=SimpleNamespace(task=["strategy=zero2", "++model.lr=0.1"]))
    monkeypatch.setattr(launcher, "_hydra_config", lambda: hc)
    argv = ["--multirun", "--config-dir", "/c", "strategy=ddp,zero2", "model.lr=0.1,0.2"]
    assert launcher._hydra_job_argv(argv) == ["--config-dir", "/c", "strategy=zero2", "++model.lr=0.1"]
    hc.mode = RunMode.RUN
    assert launcher._hydra_job_argv(argv) == argv


@pytest.mark.parametrize("command", ["train.py", "tune.py"])
def test_the_commands_do_not_import_the_examples(command):
    tree = ast.parse((ROOT / command).read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [n for n in names if "examples" in n], names


# ---------------------------------------------------------------------- a script's own entry point
SCRIPT = '''
import sys
sys.path.insert(0, {pkg!r})
from userpkg.models import Points, Regressor
import zerotrain.cli

if __name__ == "__main__":
    zerotrain.cli.main(Regressor, Points)
'''


@pytest.mark.slow  # moved out of the default suite for its 15-minute budget (16.2 min on an AVX2 EPYC)
@pytest.mark.timeout(300)
def test_a_scripts_main_gives_the_same_command_line(tmp_path):
    """``zerotrain.cli.main(MyModule, MyData)`` in a script: the classes are the default targets,
    the keys are checked as zerotrain-train's (rc 2, one line), and it trains."""
    import subprocess
    import sys

    pkg = write_package(tmp_path / "pkg")
    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT.format(pkg=str(pkg)))
    run = [sys.executable, str(script), "trainer.devices=1", "trainer.max_steps=2", "trainer.val_check_interval=1.0",
           "callbacks.tensorboard=false", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}/run"]
    bad = subprocess.run(run + ["model.hidden=abc"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "zerotrain-train: configuration error: model.hidden='abc': Expected a <class 'int'>. Got value: abc; "
        "valid: hidden: int, as userpkg.models.Regressor takes it"], bad.stderr[-3000:]
    good = subprocess.run(run + ["model.hidden=4", "data.batch_size=8"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert good.returncode == 0, good.stderr[-3000:]
    assert "done: 2 steps" in good.stdout
    assert "_target_: userpkg.models.Regressor" in (tmp_path / "run" / "checkpoints" / "config.yaml").read_text()
