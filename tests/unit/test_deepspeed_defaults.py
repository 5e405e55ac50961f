"""Every DeepSpeed config key zerotrain.deepspeed reads takes DeepSpeed 0.19.8's default when absent
(``trainer/compat/deepspeed/defaults.py``, the README's table), except the speed/memory-only keys the table
marks with a reason. When DeepSpeed is installed, its own constants, config models and signatures
are read (in a subprocess: this process does not import DeepSpeed) and compared with the table;
without it those tests skip and the table is still checked against what ``parse`` does."""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from zerotrain.trainer.compat.deepspeed.config import ActivationCheckpointing, SCHEDULERS, parse
from zerotrain.trainer.compat.deepspeed.defaults import DEFAULTS, SCHEDULER_SOURCE, default, markdown_table

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (zerotrain's `dev` extra)")

_RESOLVE = r"""
import importlib, inspect, json, sys
wheres, schedulers, source = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

def resolve(where):
    module, _, name = where.partition(":")
    mod = importlib.import_module(module)
    if name.endswith(")"):  # Class(arg): a keyword default of Class.__init__
        cls, arg = name[:-1].split("(")
        return inspect.signature(getattr(mod, cls).__init__).parameters[arg].default
    if "." in name:  # Class.field: a pydantic field's default
        cls, field = name.split(".")
        return getattr(mod, cls).model_fields[field].default
    return getattr(mod, name)

def kwargs_defaults(cls):
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}

lr = importlib.import_module(source)
print(json.dumps({"keys": {w: resolve(w) for w in wheres},
                  "schedulers": {n: kwargs_defaults(getattr(lr, n)) for n in schedulers}}))
"""


def _json(value):
    return json.loads(json.dumps(value))


@pytest.fixture(scope="module")
def deepspeed_values() -> dict:
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps([d.where for d in DEFAULTS]),
                           json.dumps(list(SCHEDULERS)), SCHEDULER_SOURCE], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_deepspeed
@pytest.mark.timeout(320)
def test_the_table_holds_the_installed_deepspeeds_defaults(deepspeed_values):
    got = deepspeed_values["keys"]
    wrong = {d.key: (d.deepspeed, got[d.where]) for d in DEFAULTS if _json(d.deepspeed) != got[d.where]}
    assert not wrong, f"table's DeepSpeed column vs the installed DeepSpeed: {wrong}"


@needs_deepspeed
@pytest.mark.timeout(320)
def test_scheduler_keyword_defaults_are_deepspeeds(deepspeed_values):
    for name, cls in SCHEDULERS.items():
        ours = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
        assert _json(ours) == deepspeed_values["schedulers"][name], name


def test_ours_are_deepspeeds_unless_the_table_says_why():
    for d in DEFAULTS:
        assert d.differs or _json(d.ours) == _json(d.deepspeed), d.key
        if d.differs:
            assert "speed/memory only" in d.differs, d.key  # nothing that changes results may differ
    assert "| `gradient_clipping` | `1.0` | `1.0` | same |" in markdown_table()


def _adam_defaults(section: dict) -> dict:
    spec = parse({"train_micro_batch_size_per_gpu": 1, "optimizer": section}, 1).optimizer
    group = spec.build([torch.zeros(1, requires_grad=True)]).param_groups[0]
    return {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}


def test_parse_takes_the_tables_defaults():
    c = parse({"train_micro_batch_size_per_gpu": 1}, 1)
    # DeepSpeed clips at 1.0 unless told otherwise (it was 0, off, here)
    assert c.gradient_clipping == default("gradient_clipping") == 1.0
    assert c.zero_allow_untested_optimizer is default("zero_allow_untested_optimizer")
    assert c.dataloader_drop_last is default("dataloader_drop_last")
    assert c.precision == "32" and c.zero_stage == default("zero_optimization.stage")
    scaler = parse({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}, 1).loss_scaler
    assert scaler == {"init_scale": 2.0 ** default("fp16.initial_scale_power"),
                      "growth_interval": default("fp16.loss_scale_window"),
                      "hysteresis": default("fp16.hysteresis"), "min_scale": float(default("fp16.min_loss_scale"))}
    ac = ActivationCheckpointing()
    for d in DEFAULTS:
        if d.key.startswith("activation_checkpointing."):
            assert getattr(ac, d.key.split(".")[1]) == d.ours, d.key


def test_adam_takes_deepspeeds_hyper_parameters():
    want = {k.split(" ")[0].rsplit(".", 1)[1]: d.ours for d in DEFAULTS for k in [d.key]
            if k.startswith("optimizer.params.") and "(Adam, AdamW)" in k and "bias" not in k}
    for section in ({"type": "Adam"}, {"type": "AdamW"}, {"type": "Adam", "params": {"adam_w_mode": False}}):
        # FusedAdam's weight_decay 0, not torch AdamW's 0.01 (an "Adam" with none got 0.01 here)
        assert _adam_defaults(section) == want, section
    # torch_adam: DeepSpeed builds torch's AdamW itself, with torch's own default
    assert _adam_defaults({"type": "Adam", "params": {"torch_adam": True}})["weight_decay"] == 0.01


def test_clipping_can_still_be_turned_off():
    assert parse({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0}, 1).gradient_clipping == 0.0


def test_the_readme_shows_the_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert markdown_table() in readme
