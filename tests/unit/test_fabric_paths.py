"""Lightning Fabric's import paths under the rename rule (``lightning.fabric`` -> ``zerotrain.fabric``,
trainer/compat/fabric_paths.py): each path imports, its names are zerotrain's own objects,
``seed_everything`` seeds as lightning_fabric's does, ``PossibleUserWarning`` is what zerotrain warns
with where Lightning does, and ``cloud_io._load`` reads the checkpoints zerotrain writes."""
from __future__ import annotations

import importlib
import os
import pathlib
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import zerotrain
from zerotrain import ConfigError, Trainer
from zerotrain.demos import BoringModel

PKG_PARENT = str(pathlib.Path(zerotrain.__file__).parent.parent)

#: Lightning's paths (after ``lightning.``), with the names each must give
PATHS = {
    "fabric": "Fabric, seed_everything, disable_possible_user_warnings",
    "fabric.utilities": "rank_zero_only, rank_zero_warn, rank_zero_info, AttributeDict",
    "fabric.utilities.seed": "seed_everything, reset_seed, isolate_rng",
    "fabric.utilities.rank_zero": "rank_zero_only, rank_zero_warn, rank_zero_info, rank_zero_debug",
    "fabric.utilities.warnings": "PossibleUserWarning, disable_possible_user_warnings",
    "fabric.utilities.imports": "_IS_WINDOWS, _TORCH_GREATER_EQUAL_2_2, _TORCH_GREATER_EQUAL_2_3, "
                                "_TORCH_GREATER_EQUAL_2_4, _TORCH_GREATER_EQUAL_2_6, _PYTHON_GREATER_EQUAL_3_10_0, "
                                "_TORCHMETRICS_GREATER_EQUAL_1_0_0",
    "fabric.utilities.exceptions": "MisconfigurationException",
    "fabric.utilities.cloud_io": "_load",
    "fabric.utilities.distributed": "_distributed_is_initialized",
    "pytorch.utilities.warnings": "PossibleUserWarning",
}


def _ours(path: str) -> str:
    return "zerotrain" + path[len("pytorch"):] if path.startswith("pytorch") else f"zerotrain.{path}"


def test_each_path_imports_in_a_fresh_interpreter():
    code = "".join(f"import {_ours(p)}\nfrom {_ours(p)} import {names}\n" for p, names in PATHS.items())
    code += "import zerotrain.fabric as f\nassert f.utilities.warnings.PossibleUserWarning.__name__\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PKG_PARENT}, cwd=PKG_PARENT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_names_are_zerotrains_own_objects():
    import zerotrain.fabric as fabric
    from zerotrain.fabric.utilities import cloud_io, distributed, exceptions, imports, seed
    from zerotrain.fabric.utilities.warnings import PossibleUserWarning
    from zerotrain.trainer import errors, utilities
    from zerotrain.trainer.api import from_checkpoint
    from zerotrain.utilities.warnings import PossibleUserWarning as pytorch_path

    assert fabric.Fabric is zerotrain.Fabric
    assert fabric.seed_everything is seed.seed_everything is zerotrain.seed_everything
    assert seed.reset_seed is utilities.reset_seed and seed.isolate_rng is zerotrain.utilities.isolate_rng
    assert PossibleUserWarning is pytorch_path is utilities.PossibleUserWarning  # one class, two paths
    assert issubclass(PossibleUserWarning, UserWarning)
    assert exceptions.MisconfigurationException is errors.MisconfigurationException
    assert issubclass(ConfigError, exceptions.MisconfigurationException)
    assert imports is zerotrain.utilities.imports
    assert cloud_io._load is from_checkpoint.load_checkpoint
    assert distributed._distributed_is_initialized is utilities.distributed_is_initialized
    assert distributed._distributed_is_initialized() is False
    with pytest.raises(ImportError):  # a path Lightning has and zerotrain does not: a plain ImportError
        importlib.import_module("zerotrain.fabric.accelerators")


def _draws() -> tuple:
    return random.random(), torch.rand(3).tolist(), np.random.rand(3).tolist()


@pytest.fixture
def _no_recorded_seed(monkeypatch):
    from zerotrain.trainer.utilities import GLOBAL_SEED_ENV

    for var in (GLOBAL_SEED_ENV, "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(var, "0")  # recorded as it was, so that the seeds set here are undone after
        monkeypatch.delenv(var)
    state = random.getstate(), torch.get_rng_state(), np.random.get_state()
    yield
    random.setstate(state[0]), torch.set_rng_state(state[1]), np.random.set_state(state[2])


@pytest.mark.usefixtures("_no_recorded_seed")
def test_seed_everything_seeds_as_lightning_fabrics():
    theirs = pytest.importorskip("lightning_fabric.utilities.seed")
    from zerotrain.fabric.utilities.seed import seed_everything

    for s in (0, 42, 2**31, 2**32 - 1):
        assert seed_everything(s) == s
        mine = _draws()
        assert theirs.seed_everything(s, verbose=False) == s
        assert _draws() == mine, s
    for bad in (-1, 2**32):  # numpy's range: both refuse with a ValueError (ours a ConfigError, one)
        with pytest.raises(ValueError, match="not in bounds"):
            theirs.seed_everything(bad)
        with pytest.raises(ValueError, match=f"seed={bad}; valid: an integer from 0 to {2**32 - 1}"):
            seed_everything(bad)
    os.environ.pop(zerotrain.trainer.utilities.GLOBAL_SEED_ENV)  # PL_GLOBAL_SEED, both libraries' variable
    with pytest.warns(UserWarning, match="seed set to 0"):  # none given nor recorded: 0, said (both)
        assert seed_everything() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        os.environ.pop(zerotrain.trainer.utilities.GLOBAL_SEED_ENV)
        assert seed_everything(verbose=False) == 0  # Lightning's verbose=False: quietly


def _fit(tmp_path, **kw):
    args = dict(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path))
    trainer = Trainer(**{**args, **kw})
    trainer.fit(BoringModel())
    return trainer


def test_possible_user_warning_where_zerotrain_warns_as_lightning(tmp_path):
    from zerotrain.fabric.utilities.warnings import PossibleUserWarning, disable_possible_user_warnings

    class Stops(BoringModel):
        def training_step(self, *args, **kwargs):
            self.trainer.should_stop = True
            return super().training_step(*args, **kwargs)

    args = dict(max_epochs=None, limit_train_batches=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer = Trainer(**args)
    with pytest.warns(PossibleUserWarning, match="`max_epochs` was not set. Setting it to 1000 epochs."):
        trainer.fit(Stops())  # at fit, as Lightning
    assert trainer.max_epochs == 1000
    with pytest.warns(PossibleUserWarning, match=r"The number of training batches \(2\) is smaller than the logging "
                                                 r"interval Trainer\(log_every_n_steps=5\)"):
        _fit(tmp_path, logger=True, log_every_n_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PossibleUserWarning)
        disable_possible_user_warnings()  # ignores them (filters put first win), as Lightning's
        Trainer(**args).fit(Stops())


def test_cloud_io_load_reads_zerotrains_checkpoints(tmp_path):
    from zerotrain.fabric.utilities.cloud_io import _load as pl_load

    trainer = _fit(tmp_path, enable_checkpointing=True)
    path = trainer.checkpoint_callback.best_model_path  # without monitor: the newest save (no last.ckpt by default)
    assert path and os.path.exists(path)
    checkpoint = pl_load(path)
    mine = trainer.lightning_module.state_dict()
    assert checkpoint["state_dict"].keys() == mine.keys()
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in mine.items())
    assert pl_load(path, map_location="cpu", weights_only=True)["state_dict"].keys() == mine.keys()
    with pytest.raises(ConfigError, match="valid: a checkpoint directory or file path, or a URL"):
        pl_load(object())  # a URL is read (tests/unit/test_conformance_url_checkpoint.py), a file object is not
