"""The three forms DeepSpeed accepts for ``config`` (a dict, a file, base64-encoded JSON) and how
it reads a file: hjson (comments, trailing commas) and a key given twice refused. Found running
DeepSpeed's own config tests (issue 42): an hjson file and a base64 string were refused here.
Where DeepSpeed is installed its ``DeepSpeedConfig`` reads the same inputs to the same values."""
from __future__ import annotations

import base64
import json

import pytest

from zerotrain import ConfigError
from zerotrain.deepspeed.config import load_config, parse

HJSON = """{
  // a comment, as DeepSpeedExamples' configs carry
  "train_batch_size": 8,
  "gradient_accumulation_steps": 2,   # another
  "optimizer": {"type": "Adam", "params": {"lr": 0.001,},},
}
"""


def _deepspeed_reads(config):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)


def test_an_hjson_file_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(HJSON)
    raw = load_config(str(path))
    assert raw == {"train_batch_size": 8, "gradient_accumulation_steps": 2,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}
    cfg = parse(str(path), world_size=1)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 4)
    assert load_config(path) == raw  # a PathLike too


def test_base64_encoded_json_is_a_config():
    raw = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.5}
    encoded = base64.urlsafe_b64encode(json.dumps(raw).encode()).decode()
    assert load_config(encoded) == raw
    assert parse(encoded, world_size=2).train_batch_size == 6


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match=r"duplicate keys \['stage'\]"):
        load_config(str(path))


def test_neither_file_nor_base64_names_the_three_forms():
    with pytest.raises(ConfigError, match="no such file; valid: a dict, the path of a JSON file, or base64"):
        load_config("missing_ds_config.json")


def test_deepspeed_reads_the_same(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(HJSON)
    ds = _deepspeed_reads(str(path))
    assert (ds.train_batch_size, ds.gradient_accumulation_steps) == (8, 2)
    encoded = base64.urlsafe_b64encode(b'{"train_micro_batch_size_per_gpu": 3}').decode()
    assert _deepspeed_reads(encoded).train_micro_batch_size_per_gpu == 3
    twice = tmp_path / "twice.json"
    twice.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ValueError):
        _deepspeed_reads(str(twice))
