"""Offload options: validation errors name the field, the value and the valid choices; the
registry, the generated Hydra schema and the YAML presets build the right strategy."""
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from zerotrain.strategies import strategy_from_name
from zerotrain.strategies.offload import Offload, OffloadPolicy, OffloadStepper
from zerotrain.strategies.zero import ZeroStage2

BAD = [
    (dict(param_device="nvme", nvme_path="/tmp"), ValueError,
     ["param_device='nvme' needs stage=3", "got stage=2", "param_device='none'"]),
    (dict(param_device="cpu"), ValueError, ["param_device='cpu' needs stage=3"]),
    (dict(param_device="gpu"), ValueError, ["param_device='gpu'", "none, cpu, nvme"]),
    (dict(optimizer_device="disk"), ValueError, ["optimizer_device='disk'", "valid choices: cpu, nvme"]),
    (dict(optimizer_device="nvme"), ValueError, ["nvme_path=None must name a directory"]),
    (dict(optimizer_device="nvme", nvme_path=""), ValueError, ["nvme_path=''"]),
    (dict(optimizer_state_dtype="fp16"), ValueError, ["optimizer_state_dtype='fp16'", "valid choices: fp32, bf16"]),
    (dict(optimizer_state_dtype="bf16"), ValueError,
     ["optimizer_state_dtype='bf16'", "optimizer_device='cpu' keeps them in RAM", "valid: optimizer_device='nvme'"]),
    (dict(stage=1), ValueError, ["stage=1", "valid choices: 2, 3"]),
    (dict(grad_device="disk"), ValueError, ["grad_device='disk'", "valid choices: cpu, nvme"]),
    (dict(grad_device="nvme"), ValueError,
     ["grad_device='nvme'", "optimizer_device='cpu' has none", "valid: optimizer_device='nvme'"]),
    (dict(grad_device="nvme", optimizer_device="nvme", nvme_path="/tmp"), ValueError,
     ["grad_device='nvme' needs stage=3", "got stage=2", "grad_device='cpu'"]),
    (dict(param_dtype="fp16"), ValueError, ["param_dtype='fp16'", "valid choices: auto, bf16"]),
    (dict(stage=3, param_dtype="bf16", param_device="cpu"), ValueError,
     ["param_dtype='bf16'", "param_device='cpu' keeps no parameter files", "valid: param_device='nvme'"]),
    (dict(buffer_count=0), ValueError, ["buffer_count=0 must be >= 1"]),
    (dict(stage=3, optimizer_device="nvme", nvme_path="/tmp", grad_device="nvme", grad_buffer_count=0), ValueError,
     ["grad_buffer_count=0 must be >= 1"]),
    (dict(stage=3, optimizer_device="nvme", nvme_path="/tmp", grad_buffer_count=8), ValueError,
     ["grad_buffer_count=8", "grad_device='cpu' keeps the gradients in RAM", "valid: grad_device='nvme'"]),
    (dict(sub_group_size=0), ValueError, ["sub_group_size=0 must be >= 1"]),
    (dict(io_threads=0), ValueError, ["io_threads=0 must be >= 1"]),
    (dict(io_block_size=1000), ValueError, ["io_block_size=1000", "multiple of 4096"]),
    (dict(sub_group_size=True), TypeError, ["sub_group_size=True must be an integer"]),
    (dict(pin_memory="yes"), TypeError, ["pin_memory='yes' must be True or False"]),
    (dict(reduce_dtype="fp8"), ValueError, ["reduce_dtype='fp8'", "fp32, bf16, fp16"]),  # the stage's own
    (dict(prefetch_bucket_size=5), ValueError, ["prefetch_bucket_size=5 is not an option of stage=2",
                                                "Stage3Config", "default 10000000"]),
    (dict(stage=3, reduce_bucket_size=5), ValueError, ["reduce_bucket_size=5 is not an option of stage=3"]),
    (dict(stage=3, max_live_parameters=0), ValueError, ["max_live_parameters=0"]),
]


@pytest.mark.parametrize("kwargs,exc,texts", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options_are_refused_with_the_field_value_and_choices(kwargs, exc, texts):
    with pytest.raises(exc) as info:
        Offload(**kwargs)
    for text in texts:
        assert text in str(info.value), str(info.value)



def test_nvme_path_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        Offload(optimizer_device="nvme", nvme_path=str(f))
    Offload(optimizer_device="nvme", nvme_path=str(tmp_path / "not_yet"))  # created at set-up


def test_stage3_composition_takes_its_options():
    from zerotrain.strategies.zero import ZeroStage3

    s = Offload(stage=3, optimizer_device="nvme", param_device="nvme", nvme_path="/tmp",
                unit_modules="Block, MLP", prefetch_bucket_size=7, reduce_dtype="bf16")
    assert type(s) is ZeroStage3 and isinstance(s.stepper, OffloadStepper) and s.stage == 3
    assert s.stage3.unit_modules == ("Block", "MLP") and s.stage3.prefetch_bucket_size == 7
    assert s.config.reduce_dtype == "bf16"


def test_construction_composes_with_the_stage():
    s = strategy_from_name("offload", sub_group_size=1000, reduce_bucket_size=1234)
    assert type(s) is ZeroStage2 and isinstance(s.stepper, OffloadStepper)
    assert s.name == "offload" and s.stage == 2
    assert s.offload == OffloadPolicy(sub_group_size=1000)
    assert s.buckets.reduce_bucket_size == 1234  # the stage's options pass through
    assert "optimizer_device" in repr(s)


PRESETS = {
    "offload": dict(stage=2, optimizer_device="cpu", param_device="none", nvme_path=None),
    "offload_cpu": dict(stage=2, optimizer_device="cpu", param_device="none"),
    "offload_nvme": dict(stage=2, optimizer_device="nvme", param_device="none", buffer_count=4),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hydra_presets_build_the_strategy(preset, tmp_path):
    import zerotrain.train  # noqa: F401  (registers the schemas)
    from zerotrain.trainer.command.config import build_strategy

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[
            f"strategy={preset}", "strategy.sub_group_size=5000", "strategy.reduce_dtype=bf16",
            f"strategy.nvme_path={tmp_path}" if preset == "offload_nvme" else "strategy.io_threads=3"]))
    s = build_strategy(cfg.strategy)
    assert isinstance(s.stepper, OffloadStepper) and s.offload.sub_group_size == 5000 and s.config.reduce_dtype == "bf16"
    for key, value in PRESETS[preset].items():
        assert getattr(s if key == "stage" else s.offload, key) == value, key


def test_hydra_rejects_wrong_types_and_bad_values():
    import zerotrain.train  # noqa: F401
    from zerotrain.trainer.command.config import build_strategy
    from zerotrain.trainer.errors import ConfigError

    with initialize_config_module(config_module="zerotrain.conf", version_base="1.3"):
        with pytest.raises(Exception, match="sub_group_size"):
            compose(config_name="config", overrides=["strategy=offload", "strategy.sub_group_size=lots"])
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=[
            "strategy=offload", "strategy.param_device=nvme", "strategy.nvme_path=/tmp"]))
    with pytest.raises(ConfigError, match="param_device='nvme' needs stage=3"):
        build_strategy(cfg.strategy)
