"""``zerotrain.deepspeed.pipe``'s stage cuts (``partition_method``) and ``LayerSpec``, DeepSpeed's way.

A script moved from DeepSpeed must put every layer on the stage DeepSpeed puts it, so the cuts are
compared with DeepSpeed 0.19.8's own ``partition_uniform`` / ``partition_balanced`` where it is
installed (those tests skip without it), and pinned by hand-worked cases otherwise.
"""
from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
from torch import nn

from zerotrain.deepspeed.pipe import LayerSpec, TiedLayerSpec
from zerotrain.trainer.errors import ConfigError
from zerotrain.trainer.compat.deepspeed.pipe.partition import balanced, boundaries, type_weights, uniform

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ds_utils():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (zerotrain's `dev` extra); these cases compare against it")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import utils

    return utils


def test_uniform_puts_the_extra_layers_first():
    assert uniform(22, 2) == [0, 11, 22]
    assert uniform(7, 3) == [0, 3, 5, 7]  # 3, 2, 2: the larger stage first (our Trainer's cut: 2, 2, 3)
    assert uniform(10, 4) == [0, 3, 6, 8, 10]


def test_balanced_minimises_the_spread_between_stages():
    # AlexNet as DeepSpeedExamples' pipeline example lists it: 22 layers, stage 0 up to the 2nd Dropout
    features = [23296, 0, 0, 307392, 0, 0, 663936, 0, 884992, 0, 590080, 0, 0]
    pool_flatten = [0, 0]
    classifier = [0, 37752832, 0, 0, 16781312, 0, 40970]
    assert balanced(features + pool_flatten + classifier, 2) == [0, 19, 22]
    assert balanced([272, 0, 272, 0, 68], 2) == [0, 2, 5]  # 272 | 340, not 544 | 68
    assert balanced([1, 1], 3) == [0, 1, 2, 2]  # fewer layers than stages: DeepSpeed's uniform cut


def test_uniform_and_balanced_match_deepspeed(ds_utils):
    rng = random.Random(0)
    for _ in range(300):
        stages = rng.randint(1, 5)
        n = rng.randint(stages + 1, 14)
        weights = [rng.choice([0, 0, 1, 2, 3, 5, 8, 100]) for _ in range(n)]
        assert uniform(n, stages) == ds_utils.partition_uniform(n, stages), (n, stages)
        assert balanced(weights, stages) == [int(b) for b in ds_utils.partition_balanced(weights, stages)], \
            (weights, stages)


def _toy_layers():
    return [LayerSpec(nn.Linear, 4, 4), nn.ReLU(), lambda x: x * 2, LayerSpec(nn.Conv1d, 2, 2, 1),
            nn.Linear(4, 3)]


def test_type_regex_weighs_matching_class_names():
    assert type_weights(_toy_layers(), "linear") == [1, 0, 0, 0, 1]  # case-insensitive search
    assert type_weights(_toy_layers(), "conv|relu") == [0, 1, 0, 1, 0]
    assert type_weights(_toy_layers(), "lambda") == [0, 0, 1, 0, 0]  # a function by its __name__
    assert boundaries(_toy_layers(), 2, "type:Linear") == [0, 4, 5]  # equal cuts: the latest split wins
    with pytest.raises(ConfigError, match="matches none of the layers"):
        type_weights(_toy_layers(), "Embedding")


def test_parameters_counts_trainable_parameters_building_each_spec():
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    built = []

    class Counted(nn.Linear):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    layers = [frozen, LayerSpec(Counted, 4, 8), nn.ReLU(), LayerSpec(Counted, 8, 2)]
    # frozen weighs 0 (DeepSpeed counts requires_grad parameters only): 0, 40 | 0 | 18 ties 0, 40, 0 | 18:
    # the latest split wins -> [0, 3, 4] (counting the frozen 20 would give [0, 1, 4])
    assert boundaries(layers, 2, "parameters") == [0, 3, 4]
    assert built == [(4, 8), (8, 2)]  # each spec built once, for real, to count it


def test_parameters_count_draws_the_global_generator_as_deepspeed_does():
    """DeepSpeed builds every LayerSpec to count it: the stages' own layers are then initialised
    from the generator after those draws. Counting on the meta device would draw nothing."""
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)]
    torch.manual_seed(7)
    boundaries(layers, 2, "parameters")
    after_count = torch.rand(3)
    torch.manual_seed(7)
    nn.Linear(4, 4), nn.Linear(4, 4)
    assert torch.equal(after_count, torch.rand(3))
    torch.manual_seed(7)
    boundaries(layers, 2, "uniform")  # builds nothing, draws nothing
    untouched = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(untouched, torch.rand(3))


@pytest.mark.parametrize("method, message", [("profile", "valid: 'parameters', 'uniform' or 'type:<regex>'"),
                                             ("balanced", "valid: 'parameters', 'uniform'"),
                                             ([0, 2, 5], "partition_method=\\[0, 2, 5\\]"),
                                             ("type:(", "not a regular expression")])
def test_bad_partition_method_is_a_config_error(method, message):
    with pytest.raises(ConfigError, match=message):
        boundaries(_toy_layers(), 2, method)


def test_a_stage_without_layers_is_refused():
    with pytest.raises(ConfigError, match="leaving a stage without layers"):
        boundaries([nn.Linear(2, 2), nn.Linear(2, 2)], 3, "uniform")


def test_method_names_are_case_insensitive():
    assert boundaries(_toy_layers(), 2, "Uniform") == boundaries(_toy_layers(), 2, "uniform") == [0, 3, 5]
    assert boundaries(_toy_layers(), 2, "TYPE:linear") == [0, 4, 5]


def test_layer_spec_keeps_deepspeed_field_names_and_builds_on_demand():
    spec = LayerSpec(nn.Linear, 3, 2, bias=False)
    assert (spec.typename, spec.module_args, spec.module_kwargs) == (nn.Linear, (3, 2), {"bias": False})
    a, b = spec.build(), spec.build()
    assert isinstance(a, nn.Linear) and a.bias is None and a is not b
    tied = TiedLayerSpec("emb", nn.Embedding, 5, 3, tied_weight_attr=["weight"])
    assert tied.key == "emb" and tied.tied_weight_attr == ("weight",) and tied.forward_fn is None
    with pytest.raises(TypeError, match="not a class or factory"):
        LayerSpec("Linear")
