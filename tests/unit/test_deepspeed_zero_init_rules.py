"""``zerotrain.deepspeed.zero.Init`` builds the weights DeepSpeed 0.19.8's ``zero.Init`` builds.

Found running DeepSpeed's examples/sdma_allgather/train_qwen3_zero3.py (bench/CONFORMANCE.md): a
transformers model built under DeepSpeed's ``zero.Init`` keeps the torch layers' constructor
initialisation, because transformers' ``post_init`` writes parameters that DeepSpeed had already
partitioned (their ``.data`` is empty then), and with bf16 in the config the layers draw their values
in bf16. zerotrain built the eager model's weights (the first loss differed: 6.224 against 6.416).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotrain.deepspeed as deepspeed

from deepspeed_unit_common import BASE, _own_group_and_checkpointing  # noqa: F401 - autouse fixture

pytestmark = pytest.mark.timeout(120)


def _normal_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)


class Net(nn.Module):
    """A parent that re-initialises its children after building them, in one of the ways models do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 64), nn.Linear(64, 64))
        with torch.no_grad():
            if how == "init_functions":  # transformers' post_init: nn.init on each parameter
                for p in self.parameters():
                    nn.init.normal_(p, std=0.02)
            elif how == "data":  # older models: in place on .data
                for p in self.parameters():
                    p.data.normal_(std=0.02)
            elif how == "operators":
                self.a.weight.mul_(3.0)
                self.a.bias[0] = 7.0
            elif how == "apply":  # Module.apply: DeepSpeed gathers for the function
                self.apply(_normal_init)


def _config(precision: dict | None = None) -> dict:
    return {**BASE, **(precision or {}), "zero_optimization": {"stage": 3},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}


def _built_under_init(how: str, precision: dict | None = None) -> tuple[dict, int]:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=_config(precision)):
        model = Net(how)
    after = torch.randint(0, 2**62, (1,)).item()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(precision))
    return engine._model.full_state_dict(), after


def _eager(how: str, dtype: torch.dtype = torch.float32) -> tuple[dict, int]:
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Net(how)
    finally:
        torch.set_default_dtype(old)
    after = torch.randint(0, 2**62, (1,)).item()
    return {k: v.float() for k, v in model.state_dict().items()}, after


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("how", ["init_functions", "data", "operators"])
def test_writes_after_a_module_is_built_do_not_reach_its_partitions(how):
    got, rng = _built_under_init(how)
    want, want_rng = _eager("constructors")
    _assert_same(got, want)
    assert rng == want_rng  # a dropped draw draws nothing, as DeepSpeed's draw into an empty tensor
    assert not torch.equal(want["a.weight"], _eager(how)[0]["a.weight"])  # the eager build differs


def test_module_apply_writes_as_in_deepspeed():
    got, rng = _built_under_init("apply")
    want, want_rng = _eager("apply")
    _assert_same(got, want)
    assert rng == want_rng


def test_gathered_parameters_with_a_modifier_rank_writes_inside_init():
    with deepspeed.zero.Init(config_dict_or_path=_config()):
        model = Net("constructors")
        with deepspeed.zero.GatheredParameters(model.a.weight, modifier_rank=0):
            model.a.weight.data.fill_(0.5)
        with deepspeed.zero.GatheredParameters(model.a.bias, modifier_rank=None):
            model.a.bias.data.fill_(0.5)  # read-only gathering: DeepSpeed keeps the partition
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    state = engine._model.full_state_dict()
    assert torch.equal(state["a.weight"], torch.full((16, 8), 0.5))
    assert not torch.equal(state["a.bias"], torch.full((16,), 0.5))


@pytest.mark.parametrize("precision,dtype", [({"bf16": {"enabled": True}}, torch.bfloat16),
                                             ({"fp16": {"enabled": True}}, torch.float16)])
def test_layers_draw_their_values_in_the_configs_16bit_type(precision, dtype):
    got, rng = _built_under_init("constructors", precision)
    want, want_rng = _eager("constructors", dtype)
    _assert_same(got, want)
    assert rng == want_rng
    fp32 = _eager("constructors")[0]
    assert any(not torch.equal(want[k], fp32[k].to(dtype).float()) for k in want)  # not the fp32 draws rounded


def test_the_rules_end_with_the_block():
    factory = torch.empty
    with deepspeed.zero.Init(config_dict_or_path=_config({"bf16": {"enabled": True}})):
        assert torch.empty(2).dtype == torch.bfloat16
        model = Net("constructors")
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config({"bf16": {"enabled": True}}))
    assert torch.empty is factory and torch.empty(2).dtype == torch.float32
    lin = nn.Linear(2, 2)
    nn.init.zeros_(lin.weight)
    assert torch.count_nonzero(lin.weight) == 0


def test_the_sdma_switch_imports_and_is_off(monkeypatch, caplog):
    """examples/sdma_allgather asks ``deepspeed.comm.mori.is_enabled()`` after ``initialize``."""
    from zerotrain.deepspeed.comm import mori
    import zerotrain.deepspeed.comm.mori as by_path

    assert by_path is mori and mori.is_enabled() is False
    assert mori.supports(torch.zeros(4)) is False and mori.allgather_into_tensor(torch.zeros(4), torch.zeros(8)) is None
    monkeypatch.setenv("DS_SDMA_ALLGATHER", "1")
    monkeypatch.setattr(mori, "_warned", False)
    with caplog.at_level("WARNING", logger="zerotrain"):
        mori.init()
    assert "no SDMA all-gather" in caplog.text


def test_an_fp32_config_draws_in_fp32_under_a_16bit_default_type():
    """transformers' ``from_config`` with ``torch_dtype=bfloat16`` sets bf16 as torch's default type
    while it builds; DeepSpeed's Init still makes fp32 tensors under an fp32 config (the sdma
    example's fp32 run differed from its first loss)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with deepspeed.zero.Init(config_dict_or_path=_config()):
            model = Net("constructors")
    finally:
        torch.set_default_dtype(old)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config())
    _assert_same(engine._model.full_state_dict(), _eager("constructors")[0])
