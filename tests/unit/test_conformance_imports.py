"""Lightning's import surface that its own public-API test modules need (issue 41): every path
registered in trainer/compat/lightning_paths.py and trainer/compat/fabric_paths.py imports, the names Lightning's
tests take from them resolve, and the helpers behind them (trainer/compat/) behave as
pytorch-lightning 2.6's, compared with it where it is installed."""
from __future__ import annotations

import importlib
import os
import pathlib
import random
import subprocess
import sys
import warnings
from argparse import Namespace

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import zerotrain
from zerotrain.trainer.compat import fabric_paths, lightning_paths

PKG_PARENT = str(pathlib.Path(zerotrain.__file__).parent.parent)

#: (Lightning's path after ``lightning.pytorch.`` / ``lightning.``, a name) that Lightning's
#: public-API test modules import at module level
NEEDED = [
    ("accelerators", "CPUAccelerator"), ("accelerators", "CUDAAccelerator"),
    ("callbacks.prediction_writer", "BasePredictionWriter"), ("callbacks", "BasePredictionWriter"),
    ("core.module", "_TrainerFabricShim"), ("core.optimizer", "_configure_optimizers"),
    ("core.optimizer", "_configure_schedulers_automatic_opt"), ("core.optimizer", "_init_optimizers_and_lr_schedulers"),
    ("core.saving", "load_hparams_from_tags_csv"), ("core.saving", "save_hparams_to_tags_csv"),
    ("fabric.plugins", "TorchCheckpointIO"), ("fabric.plugins", "XLACheckpointIO"),
    ("fabric.utilities.data", "_auto_add_worker_init_fn"), ("fabric.utilities.data", "has_iterable_dataset"),
    ("fabric.utilities.logger", "_convert_params"), ("fabric.utilities.logger", "_sanitize_params"),
    ("loggers", "CometLogger"), ("loggers", "MLFlowLogger"), ("loggers", "WandbLogger"),
    ("loggers.mlflow", "_MLFLOW_AVAILABLE"), ("loggers.logger", "DummyExperiment"),
    ("loggers.utilities", "_scan_checkpoints"), ("loops", "_Loop"), ("loops", "_EvaluationLoop"),
    ("loops", "_FitLoop"), ("loops.optimization.automatic", "Closure"), ("loops.utilities", "_no_grad_context"),
    ("loops.progress", "_BaseProgress"),
    ("overrides.distributed", "UnrepeatedDistributedSampler"), ("overrides.distributed", "_IndexBatchSamplerWrapper"),
    ("profilers", "PassThroughProfiler"), ("profilers.simple", "SimpleProfiler"),
    ("strategies", "SingleDeviceXLAStrategy"), ("strategies.launchers", "_MultiProcessingLauncher"),
    ("strategies.launchers", "_SubprocessScriptLauncher"),
    ("trainer.configuration_validator", "__verify_eval_loop_configuration"),
    ("trainer.configuration_validator", "__verify_train_val_loop_configuration"),
    ("trainer.connectors.data_connector", "_request_dataloader"),
    ("trainer.connectors.logger_connector.fx_validator", "_FxValidator"),
    ("trainer.connectors.logger_connector.result", "_ResultCollection"), ("tuner.tuning", "Tuner"),
    ("utilities", "is_picklable"), ("utilities", "CombinedLoader"), ("utilities.combined_loader", "CombinedLoader"),
    ("utilities.data", "has_len_all_ranks"), ("utilities.types", "LRSchedulerConfig"),
    ("plugins", "HalfPrecision"), ("plugins", "DoublePrecision"), ("plugins", "MixedPrecision"),
    ("plugins", "Precision"), ("plugins", "CheckpointIO"), ("plugins.precision", "DeepSpeedPrecision"),
    ("plugins.io.async_plugin", "AsyncCheckpointIO"), ("plugins.layer_sync", "TorchSyncBatchNorm"),
    ("plugins.environments", "LightningEnvironment"), ("fabric.plugins.environments", "SLURMEnvironment"),
    ("fabric.plugins.environments", "TorchElasticEnvironment"), ("fabric.plugins", "ClusterEnvironment"),
]


@pytest.fixture(autouse=True)
def _lightning_env(monkeypatch):
    """pytorch-lightning sets this variable when imported: restore the environment after."""
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)


def _pl():
    return pytest.importorskip("pytorch_lightning")


# ---------------------------------------------------------------------------- the paths
def test_every_registered_path_and_name_imports_in_a_fresh_interpreter():
    paths = [f"zerotrain.{p}" for p in lightning_paths.PATHS]
    paths += [f"zerotrain.fabric.{p}" for p in (*fabric_paths.MODULES, *fabric_paths.NAMESPACES) if p]
    code = "".join(f"import {p}\n" for p in paths)
    code += "".join(f"from zerotrain.{p} import {n}\n" for p, n in NEEDED)
    code += "".join(f"from zerotrain.{p} import {n}\n" for p, names in lightning_paths.NAMES.items() for n in names)
    code += "print('ok')\n"
    env = {**os.environ, "PYTHONPATH": PKG_PARENT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_names_exist_in_lightning_too():
    _pl()
    for path, name in NEEDED:
        theirs = f"lightning_fabric{path[len('fabric'):]}" if path.startswith("fabric") else f"pytorch_lightning.{path}"
        assert hasattr(importlib.import_module(theirs), name), (path, name)


def test_lightnings_internal_objects_import_but_say_zerotrain_has_none():
    from zerotrain.loops import _FitLoop
    from zerotrain.strategies import SingleDeviceXLAStrategy

    from zerotrain.fabric.plugins.environments import SLURMEnvironment
    from zerotrain.plugins import HalfPrecision, Precision

    assert issubclass(HalfPrecision, Precision)
    for cls in (_FitLoop, SingleDeviceXLAStrategy, zerotrain.loggers.WandbLogger, HalfPrecision, SLURMEnvironment):
        with pytest.raises(NotImplementedError, match="zerotrain has no such object"):
            cls()  # (the Tuner is no such object any more: tests/unit/test_conformance_tuning.py)


# ---------------------------------------------------------------------------- data helpers
class _Iterable(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class _IterableWithLen(_Iterable):
    def __len__(self):
        return 4


def test_has_len_all_ranks_and_has_iterable_dataset_as_lightning():
    from zerotrain.fabric.utilities.data import has_iterable_dataset
    from zerotrain.utilities.data import has_len_all_ranks

    trainer = zerotrain.Trainer(max_steps=1, logger=False, enable_checkpointing=False)
    assert not has_len_all_ranks(DataLoader(_Iterable()), trainer.strategy)
    assert has_iterable_dataset(DataLoader(_Iterable())) and not has_iterable_dataset(DataLoader(range(3)))
    with pytest.warns(UserWarning, match="Your `IterableDataset` has `__len__` defined"):
        assert has_len_all_ranks(DataLoader(_IterableWithLen()), trainer.strategy)
    with pytest.warns(UserWarning, match="Total length of `DataLoader` across ranks is zero"):
        assert has_len_all_ranks(DataLoader(range(0)), trainer.strategy)


def test_auto_add_worker_init_fn_only_after_seed_everything_workers(monkeypatch):
    from zerotrain.fabric.utilities.data import _auto_add_worker_init_fn

    def own(_):
        pass

    loader = DataLoader(range(4))
    _auto_add_worker_init_fn(loader, 0)
    assert loader.worker_init_fn is None
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    loader.worker_init_fn = own
    _auto_add_worker_init_fn(loader, 0)
    assert loader.worker_init_fn is own
    loader.worker_init_fn = None
    _auto_add_worker_init_fn(loader, 0)
    assert loader.worker_init_fn is not None


@pytest.mark.parametrize("worker_id, rank", [(0, 0), (3, 1), (1, 7)])
def test_worker_seeding_draws_lightnings_numbers(worker_id, rank):
    pytest.importorskip("lightning_fabric")
    np = pytest.importorskip("numpy")
    from lightning_fabric.utilities.seed import pl_worker_init_function

    from zerotrain.trainer.compat.lightning.data import seed_worker

    draws = []
    for fn in (pl_worker_init_function, seed_worker):
        torch.manual_seed(1234 + worker_id)  # a worker's torch seed is its base seed + its id
        fn(worker_id, rank)
        draws.append((np.random.rand(3).tolist(), random.random(), torch.rand(3).tolist()))
    assert draws[0] == draws[1]


def test_request_dataloader_calls_the_source():
    from zerotrain.trainer.connectors.data_connector import _request_dataloader

    loader = DataLoader(range(2))
    assert _request_dataloader(Namespace(dataloader=lambda: loader)) is loader
    assert _request_dataloader(lambda: loader) is loader


@pytest.mark.parametrize("mode", ["min_size", "max_size_cycle", "max_size", "sequential"])
def test_combined_loader_iterates_as_lightnings(mode):
    _pl()
    from pytorch_lightning.utilities.combined_loader import CombinedLoader as Theirs

    from zerotrain.utilities.combined_loader import CombinedLoader

    iterables = {"a": range(5), "b": [range(10, 12), range(20, 23)], "c": (range(0),)}
    ours, theirs = CombinedLoader(iterables, mode), Theirs(iterables, mode)
    iter(ours), iter(theirs)
    assert len(ours) == len(theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(ours) == list(theirs)
    with pytest.raises(ValueError, match="Unsupported mode 'zip'"):
        CombinedLoader(iterables, "zip")


# ---------------------------------------------------------------------------- parsing, saving, loggers
def test_is_picklable_as_lightnings():
    _pl()
    import threading

    from pytorch_lightning.utilities.parsing import is_picklable as theirs

    from zerotrain.utilities import is_picklable

    objects = [1, "a", [1, {"b": 2}], lambda: 1, threading.Lock(), torch.nn.Linear(2, 2), Namespace(a=1),
               (x for x in range(2)), torch.optim.SGD]
    assert [is_picklable(o) for o in objects] == [theirs(o) for o in objects]
    assert [is_picklable(o) for o in objects] == [True, True, True, False, False, True, True, False, True]


def test_tags_csv_is_lightnings_file_and_reads_back(tmp_path):
    _pl()
    from pytorch_lightning.core.saving import load_hparams_from_tags_csv as load_theirs
    from pytorch_lightning.core.saving import save_hparams_to_tags_csv as save_theirs

    from zerotrain.core.saving import load_hparams_from_tags_csv, save_hparams_to_tags_csv

    hparams = Namespace(batch_size=32, lr=0.001, root="./any/path", flag=True, sizes=[1, 2], name="x,y")
    save_hparams_to_tags_csv(tmp_path / "ours.csv", hparams)
    save_theirs(tmp_path / "theirs.csv", hparams)
    assert (tmp_path / "ours.csv").read_text() == (tmp_path / "theirs.csv").read_text()
    assert load_hparams_from_tags_csv(tmp_path / "theirs.csv") == load_theirs(tmp_path / "ours.csv") == vars(hparams)
    with pytest.warns(RuntimeWarning, match="Missing Tags"):
        assert load_hparams_from_tags_csv(tmp_path / "none.csv") == {}
    with pytest.raises(RuntimeError, match="Missing folder"):
        save_hparams_to_tags_csv(tmp_path / "no" / "x.csv", {})


def test_logger_param_helpers_as_lightnings():
    pytest.importorskip("lightning_fabric")
    np = pytest.importorskip("numpy")
    from lightning_fabric.utilities import logger as theirs

    from zerotrain.fabric.utilities import logger as ours

    def params():
        return {"f": 0.3, "i": 1, "s": "abc", "b": True, "l": [1, 2], "ns": Namespace(foo=3), "cls": torch.nn.Linear,
                "np": np.float32(0.5), "n": None, "t": torch.tensor(1.0),
                "nested": {"a": {"b": 1}, "c": Namespace(d=2)}}

    for fn in ("_convert_params", "_sanitize_params", "_flatten_dict"):
        assert repr(getattr(ours, fn)(params())) == repr(getattr(theirs, fn)(params())), fn
    assert ours._convert_params(None) == {} and ours._convert_params(Namespace(a=1)) == {"a": 1}
    assert ours._add_prefix({"a": 1}, "p", "-") == theirs._add_prefix({"a": 1}, "p", "-") == {"p-a": 1}


def test_scan_checkpoints_as_lightnings(tmp_path):
    _pl()
    from pytorch_lightning.loggers.utilities import _scan_checkpoints as theirs

    from zerotrain.loggers.utilities import _scan_checkpoints

    files = []
    for i in range(3):
        files.append(str(tmp_path / f"{i}.ckpt"))
        pathlib.Path(files[-1]).write_text("")
        os.utime(files[-1], (100 + i, 100 + i))
    cb = Namespace(best_k_models={files[0]: 0.5, files[1]: 0.2}, best_model_path=files[1], best_model_score=0.2,
                   last_model_path=files[2], current_score=0.7)
    assert _scan_checkpoints(cb, {}) == theirs(cb, {}) and len(_scan_checkpoints(cb, {})) == 3
    logged = {files[0]: 200.0, files[1]: 50.0}
    assert _scan_checkpoints(cb, logged) == theirs(cb, logged)
    assert [c[1] for c in _scan_checkpoints(cb, logged)] == files[1:]


def test_dummy_experiment_is_the_dummy_loggers():
    from zerotrain.loggers.logger import DummyExperiment, DummyLogger

    assert isinstance(DummyLogger().experiment, DummyExperiment)


# ---------------------------------------------------------------------------- profilers, loops, samplers
def test_simple_profiler_times_actions(tmp_path):
    from zerotrain.profilers import PassThroughProfiler, SimpleProfiler

    profiler = SimpleProfiler(dirpath=tmp_path, filename="p")
    for _ in range(3):
        with profiler.profile("step"):
            pass
    assert len(profiler.recorded_durations["step"]) == 3 and "step" in profiler.summary()
    with pytest.raises(ValueError, match="never started"):
        profiler.stop("other")
    profiler.describe()
    assert "step" in (tmp_path / "p.txt").read_text()
    assert PassThroughProfiler().summary() == ""


def test_no_grad_context_runs_a_loop_without_grad_or_in_inference_mode():
    from zerotrain.loops import _Loop
    from zerotrain.loops.utilities import _no_grad_context

    class Loop(_Loop):
        inference_mode = False

        @_no_grad_context
        def run(self):
            return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    class NotALoop:
        run = Loop.run

    loop = Loop(trainer=None)
    assert loop.run() == (False, False)
    loop.inference_mode = True
    assert loop.run() == (False, True)
    with pytest.raises(TypeError, match="NotALoop` needs to be a Loop"):
        NotALoop().run()


@pytest.mark.parametrize("shuffle", [False, True])
def test_unrepeated_distributed_sampler_as_lightnings(shuffle):
    _pl()
    from pytorch_lightning.overrides.distributed import UnrepeatedDistributedSampler as Theirs

    from zerotrain.overrides.distributed import UnrepeatedDistributedSampler

    data = list(range(10))
    for rank in range(3):
        ours = UnrepeatedDistributedSampler(data, num_replicas=3, rank=rank, shuffle=shuffle)
        theirs = Theirs(data, num_replicas=3, rank=rank, shuffle=shuffle)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_accelerators_answer_lightnings_class_questions():
    from zerotrain.accelerators import CPUAccelerator, CUDAAccelerator

    assert CPUAccelerator.is_available() and CPUAccelerator.parse_devices("2") == 2
    assert CPUAccelerator.get_parallel_devices(2) == [torch.device("cpu")] * 2
    assert CUDAAccelerator.is_available() == torch.cuda.is_available()
    with pytest.raises(ValueError, match="devices=0"):
        CPUAccelerator.parse_devices(0)


def test_torch_checkpoint_io_round_trips(tmp_path):
    from zerotrain.fabric.plugins import TorchCheckpointIO

    io = TorchCheckpointIO()
    path = tmp_path / "sub" / "x.ckpt"
    io.save_checkpoint({"w": torch.ones(2), "step": 3}, path)
    got = io.load_checkpoint(path)
    assert torch.equal(got["w"], torch.ones(2)) and got["step"] == 3
    io.remove_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("true",))  # what a hostile checkpoint would carry


def test_torch_checkpoint_io_never_unpickles_code(tmp_path):
    from zerotrain.fabric.plugins import TorchCheckpointIO

    path = tmp_path / "hostile.ckpt"
    torch.save({"x": _RunsCode()}, path)
    io = TorchCheckpointIO()
    with pytest.raises(Exception, match="Weights only load failed"):
        io.load_checkpoint(path)  # the default (None) loads weights only, as every zerotrain load
    with pytest.raises(ValueError, match="weights_only=False"):
        io.load_checkpoint(path, weights_only=False)


# ---------------------------------------------------------------------------- the configuration checks
def test_configuration_validator_refuses_what_lightning_refuses():
    from zerotrain.demos.boring_classes import BoringModel
    from zerotrain.trainer.configuration_validator import (__verify_eval_loop_configuration,
                                                           __verify_train_val_loop_configuration)
    from zerotrain.utilities.exceptions import MisconfigurationException

    class Old(BoringModel):
        def validation_epoch_end(self, outputs):
            pass

    class NoTest(BoringModel):
        test_step = zerotrain.TrainModule.test_step

    with pytest.raises(NotImplementedError, match="`validation_epoch_end` has been removed in v2.0.0. `Old`"):
        __verify_train_val_loop_configuration(None, Old())
    with pytest.raises(NotImplementedError, match="use the `on_validation_epoch_end` hook"):
        __verify_eval_loop_configuration(Old(), "val")
    with pytest.raises(MisconfigurationException, match=r"No `test_step\(\)` method defined to run `Trainer.test`"):
        __verify_eval_loop_configuration(NoTest(), "test")
    __verify_eval_loop_configuration(BoringModel(), "predict")


def test_prediction_writer_gets_each_batch_and_the_epoch():
    from zerotrain.callbacks import BasePredictionWriter
    from zerotrain.demos.boring_classes import BoringModel, RandomDataset

    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__("batch_and_epoch")
            self.batches, self.epochs = [], []

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.batches.append((batch_idx, dataloader_idx))

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epochs.append(len(predictions))

    writer = Writer()
    trainer = zerotrain.Trainer(callbacks=[writer], logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.predict(BoringModel(), DataLoader(RandomDataset(32, 6), batch_size=2))
    assert writer.batches == [(0, 0), (1, 0), (2, 0)] and writer.epochs == [3]
    with pytest.raises(ValueError, match="write_interval='step'"):
        BasePredictionWriter("step")
