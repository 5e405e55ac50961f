"""Every config default is written once, in the library's dataclasses: the YAML files under conf/
select a schema and hold no literal that differs from it, and the schemas are generated from the
option dataclasses (strategies, precision) rather than restating them."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

import zerotrain
import zerotrain.train  # noqa: F401  (registers the schemas)
from zerotrain.strategies import registry
from zerotrain.strategies.base import PROCESS_GROUP_TIMEOUT_S
from zerotrain.strategies.precision import DynamicLossScaler
from zerotrain.trainer.command import config as tc

CONF = pathlib.Path(zerotrain.__file__).parent / "conf"
YAMLS = sorted(p for p in CONF.rglob("*.yaml") if p.parent != CONF)


def _schema_node(name: str):
    return ConfigStore.instance().load(f"{name}.yaml").node


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(CONF)) for p in YAMLS])
def test_yaml_holds_no_literal_that_differs_from_its_schema(path):
    text = OmegaConf.load(path)
    if "_target_" in text.keys() and "defaults" not in text:  # a target's option: its signature is the schema
        return _check_target_option(path, text)
    defaults = list(text.pop("defaults", []))
    bases = [d for d in defaults if isinstance(d, str) and d.startswith("/schema_")]
    assert len(bases) == 1, f"{path}: selects no schema (defaults: {defaults})"
    node = _schema_node(bases[0][1:])
    for key, value in text.items():
        assert key in node, f"{path}: {key} is in no schema field"
        assert OmegaConf.to_container(OmegaConf.create({"v": value}))["v"] == node[key], (
            f"{path}: {key}={value!r} differs from the schema's default {node[key]!r}: write it once, "
            "in the dataclass (or the preset in strategies/registry.py)")


def _check_target_option(path, text):
    """An option of a ``_target_`` (``model=llama_tiny``, ``data=lm_text``, the empty ``target``):
    each key is an argument of the target and differs from its default there (written once)."""
    import inspect

    from hydra.utils import get_object

    if OmegaConf.is_missing(text, "_target_"):  # the empty option: the user names the target
        assert set(text) == {"_target_"}, path
        return
    params = inspect.signature(get_object(text._target_)).parameters
    for key, value in text.items():
        if key.startswith("_"):
            continue
        assert key in params, f"{path}: {key} is no argument of {text._target_}"
        default = params[key].default
        assert default is inspect.Parameter.empty or OmegaConf.to_container(OmegaConf.create({"v": value}))["v"] \
            != default, f"{path}: {key}={value!r} is {text._target_}'s default: write it once, in the signature"


@pytest.mark.parametrize("name", registry.available())
def test_strategy_schema_defaults_are_the_option_dataclasses(name):
    """The schema of each preset holds exactly its dataclasses' fields, with their defaults except
    where the preset sets a value."""
    preset = registry.get(name)
    node = _schema_node(tc.schema_name("strategy", name))
    expected = {f.name: f.default for cls in preset.options for f in dataclasses.fields(cls)}
    expected.update(preset.values)
    for key, default in expected.items():
        got = node[key]
        assert (tuple(got) if isinstance(default, tuple) and got is not None else got) == default, (name, key)
    mesh = {f"{axis}_parallel" for axis in ("sequence", "tensor") if axis in getattr(preset.build, "mesh_axes", ())}
    assert set(node) == {"name", "process_group_timeout_s", *mesh, *expected}
    assert all(node[key] == 1 for key in mesh)  # the mesh's sequence and tensor axes: 1 unless given
    assert node["process_group_timeout_s"] == PROCESS_GROUP_TIMEOUT_S


def test_precision_schema_is_the_loss_scaler():
    node = OmegaConf.structured(tc.PrecisionConfig)
    for f in dataclasses.fields(DynamicLossScaler):
        assert node[f.name] == f.default, f.name
    assert "growth_factor" in node  # once missing from the CLI


def test_reduce_bucket_size_keeps_its_name_to_the_collective(tmp_path):
    """One name from the command line to the object that cuts the buckets."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[
            "strategy=zero2", "strategy.reduce_bucket_size=1234"]))
    s = tc.build_strategy(cfg.strategy)
    assert s.buckets.reduce_bucket_size == 1234
    lib = pathlib.Path(zerotrain.__file__).parent / "strategies"
    for path in lib.rglob("*.py"):
        # moe/'s "capacity" is DeepSpeed-MoE's own term (an expert's token slots), not a bucket size
        for word in ("bucket_numel",) + (("capacity",) if "moe" not in path.relative_to(lib).parts else ()):
            assert word not in path.read_text(), f"{path}: the reduce bucket size is called {word} there"
