"""Fabric's utility helpers and import paths found by running Lightning Fabric's own tests renamed
(bench/CONFORMANCE.md, "Fabric's own tests"): the paths its tests import load
(``zerotrain.fabric.fabric``, ``.wrappers``, ``.strategies``, ``.utilities.apply_func``, the seed and
RNG-state helpers), ``seed_everything`` reports a missing, invalid or out-of-bounds seed as Fabric
does, and hyperparameters flatten and sanitize as Fabric's logger helpers (compared with the
installed lightning where present)."""
from __future__ import annotations

import dataclasses
import os
import random
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

pytestmark = pytest.mark.timeout(120)


def test_fabric_paths_its_tests_import_give_zerotrains_objects():
    from zerotrain.fabric.fabric import Fabric
    from zerotrain.fabric.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy
    from zerotrain.fabric.strategies.strategy import _Sharded
    from zerotrain.fabric.wrappers import _FabricDataLoader, _FabricModule, _FabricOptimizer, _unwrap_objects, is_wrapped
    from zerotrain import Engine
    from zerotrain.strategies import Strategy as OurStrategy

    assert issubclass(Fabric, Engine) and Strategy is OurStrategy and issubclass(DDPStrategy, OurStrategy)
    assert issubclass(SingleDeviceStrategy, OurStrategy) and _Sharded.__abstractmethods__
    with pytest.raises(NotImplementedError, match="zerotrain"):
        DeepSpeedStrategy()
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, wrapped_opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(range(4)))
    assert isinstance(wrapped, _FabricModule) and isinstance(wrapped_opt, _FabricOptimizer)
    assert isinstance(loader, _FabricDataLoader) and all(map(is_wrapped, (wrapped, wrapped_opt, loader)))
    assert not is_wrapped(model)
    assert _unwrap_objects({"m": wrapped, "o": [wrapped_opt, loader], "x": 1}) == {"m": model, "o": [opt, loader.loader],
                                                                                   "x": 1}


def test_apply_func_helpers():
    from zerotrain.fabric.utilities.apply_func import convert_tensors_to_scalars, move_data_to_device

    class MovesInPlace:
        def to(self, device):
            return None

    obj = MovesInPlace()
    assert move_data_to_device(obj, "cpu") is obj
    assert move_data_to_device({"a": [torch.ones(1)]}, torch.device("cpu"))["a"][0].device.type == "cpu"
    assert convert_tensors_to_scalars({"a": torch.tensor([2.0]), "b": "s"}) == {"a": 2.0, "b": "s"}
    with pytest.raises(ValueError, match="does not contain a single element"):
        convert_tensors_to_scalars([torch.ones(2)])


def test_rng_states_round_trip_and_worker_seeds():
    from zerotrain.fabric.utilities.seed import _collect_rng_states, _generate_seed_sequence, _set_rng_states

    states = _collect_rng_states()
    draws = (torch.rand(2), np.random.rand(), random.random())
    _set_rng_states(states)
    again = (torch.rand(2), np.random.rand(), random.random())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    seeds = {_generate_seed_sequence(s, worker_id=0, global_rank=0, count=1)[0] for s in range(200)}
    assert len(seeds) == 200


def test_rank_from_the_environment_and_sampler_epoch():
    from zerotrain.fabric.utilities.data import _set_sampler_epoch
    from zerotrain.fabric.utilities.rank_zero import _get_rank

    with mock.patch.dict(os.environ, {"JSM_NAMESPACE_RANK": "3", "SLURM_PROCID": "2"}, clear=True):
        assert _get_rank() == 2
    with mock.patch.dict(os.environ, {}, clear=True):
        assert _get_rank() is None
    loader = DataLoader(range(8), sampler=DistributedSampler(range(8), num_replicas=2, rank=0))
    _set_sampler_epoch(loader, 5)
    assert loader.sampler.epoch == 5


def test_seed_everything_reports_bad_seeds_as_fabric():
    from zerotrain.fabric.utilities.seed import seed_everything

    with mock.patch.dict(os.environ, {}, clear=True), pytest.warns(UserWarning, match="No seed found"):
        assert seed_everything() == 0
    with mock.patch.dict(os.environ, {"PL_GLOBAL_SEED": "invalid"}, clear=True):
        with pytest.raises(ValueError, match="Invalid seed specified"):
            seed_everything()
    with mock.patch.dict(os.environ, {}, clear=True):
        with pytest.raises(ValueError, match="is not in bounds"):
            seed_everything(-1)


@dataclasses.dataclass
class _Inner:
    c: int


@dataclasses.dataclass
class _Outer:
    a: _Inner
    b: int


class _Cls:
    pass


def _params() -> dict:
    return {"dl": [{"a": 1}, {"b": 2}], "l": [1, 2], "dc": _Outer(_Inner(3), 4), "n": {"x": {"y": 5}}}


def test_hyperparameters_flatten_and_sanitize_as_fabrics_helpers():
    from zerotrain.fabric.utilities.logger import _flatten_dict, _sanitize_callable_params

    flat = _flatten_dict(_params())
    assert flat == {"dl/0/a": 1, "dl/1/b": 2, "l": [1, 2], "dc/a/c": 3, "dc/b": 4, "n/x/y": 5}
    assert _sanitize_callable_params({"cls": _Cls, "f": lambda: "v"}) == {"cls": "_Cls", "f": "v"}
    theirs = pytest.importorskip("lightning.fabric.utilities.logger")
    assert flat == theirs._flatten_dict(_params())
    assert theirs._sanitize_callable_params({"cls": _Cls, "f": lambda: "v"}) == {"cls": "_Cls", "f": "v"}


def test_fabric_tensorboard_logger_root_dir_is_the_argument(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from zerotrain.fabric.loggers import TensorBoardLogger

    monkeypatch.setenv("FAB42_DIR", str(tmp_path))
    logger = TensorBoardLogger("$FAB42_DIR/logs", name="name", version="v", sub_dir="sub")
    assert logger.root_dir == "$FAB42_DIR/logs"
    assert logger.log_dir == os.path.join(str(tmp_path), "logs", "name", "v", "sub")


def test_device_dtype_mixin_tracks_moves_and_dtype_context():
    from zerotrain.fabric.plugins.precision.utils import _DtypeContextManager
    from zerotrain.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    class Inner(_DeviceDtypeModuleMixin):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    class Outer(_DeviceDtypeModuleMixin):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

    with _DtypeContextManager(torch.float64):
        built = Outer()
    assert torch.get_default_dtype() == torch.float32 and built.dtype == built.inner.dtype == torch.float64
    model = Outer()
    assert (model.dtype, model.device) == (torch.float32, torch.device("cpu"))
    model.half()
    assert model.inner.dtype == torch.float16 and model.inner.layer.weight.dtype == torch.float16
    model.to(torch.device("cpu"), torch.float64)
    assert model.dtype == model.inner.dtype == torch.float64
