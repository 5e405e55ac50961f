"""Checkpoints as Lightning's users and tests see them (issue 41), beside pytorch-lightning 2.6
where it is installed:

* unsharded state (one process, ``ddp``) saved to ``NAME.ckpt`` is one file that
  ``torch.load(weights_only=True)`` reads as Lightning's dict, written atomically, loaded safely,
  resumed exactly; a folder of such files needs no ``latest`` pointer;
* ModelCheckpoint: ``.ckpt`` names, ``format_checkpoint_name``'s signature, ``epoch``/``step`` as
  monitor candidates, Lightning's argument errors, ``state_key``, ``current_score`` (NaN: the
  worst), its state in the checkpoint, ``to_yaml``; one ``torch.save`` per checkpoint.
"""
from __future__ import annotations

import os
import warnings
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import CheckpointError, Trainer, TrainModule
from zerotrain.callbacks import ModelCheckpoint
from zerotrain.trainer.checkpoint import directory as checkpoint_io
from zerotrain.utilities.exceptions import MisconfigurationException

pytestmark = pytest.mark.timeout(120)

#: the keys of a checkpoint Lightning's Trainer writes for a module with a scheduler
LIGHTNING_KEYS = {"epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
                  "optimizer_states", "lr_schedulers", "hyper_parameters", "hparams_name"}


def _module(base, log=None):
    torch.manual_seed(0)  # the same initial weights every time

    class M(base):
        def __init__(self, width: int = 3):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(width, 1)
            self.register_buffer("seen", torch.zeros(()))

        def training_step(self, batch, batch_idx):
            loss = self.net(batch[0]).pow(2).mean()
            self.seen += 1
            if log:
                self.log(log, float("nan") if log == "nan" else loss)
            return loss

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(8, 3, generator=g)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(2, 3)), batch_size=2)

    return M()


def _trainer(tmp_path, lib="ours", **kw):
    common = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    if lib == "ours":
        return Trainer(stall_timeout_s=None, **common, **kw)
    pl = pytest.importorskip("pytorch_lightning")
    return pl.Trainer(**common, **kw)


def _fit_and_save(tmp_path, lib="ours", name="model.ckpt", **kw):
    base = TrainModule if lib == "ours" else pytest.importorskip("pytorch_lightning").LightningModule
    module = _module(base)
    trainer = _trainer(tmp_path / lib, lib, max_steps=3, enable_checkpointing=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    path = tmp_path / lib / name
    trainer.save_checkpoint(str(path))
    return module, trainer, path


# ---------------------------------------------------------------------------- the file

def test_save_checkpoint_to_a_ckpt_path_writes_lightnings_dict_in_one_file(tmp_path):
    module, trainer, path = _fit_and_save(tmp_path)
    assert path.is_file() and sorted(os.listdir(path.parent)) == ["model.ckpt"]  # no pointer, no .tmp
    ckpt = torch.load(path, weights_only=True)
    assert LIGHTNING_KEYS <= set(ckpt)
    assert (ckpt["epoch"], ckpt["global_step"]) == (trainer.current_epoch, 3)
    assert ckpt["hyper_parameters"] == {"width": 3}
    want = module.state_dict()
    assert list(ckpt["state_dict"]) == list(want)
    for k, v in want.items():
        assert torch.equal(ckpt["state_dict"][k], v), k
    opt = trainer.optimizer.state_dict()
    saved = ckpt["optimizer_states"][0]
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in opt["param_groups"]]
    assert saved["param_groups"][0]["lr"] == opt["param_groups"][0]["lr"]
    for i, st in opt["state"].items():
        assert set(saved["state"][i]) == set(st)
        for k, v in st.items():
            assert torch.equal(saved["state"][i][k], v), (i, k)
    assert ckpt["lr_schedulers"] == [trainer.lr_scheduler_configs[0].scheduler.state_dict()]


def test_the_file_has_the_keys_of_lightnings(tmp_path):
    pytest.importorskip("pytorch_lightning")
    _, _, ours = _fit_and_save(tmp_path)
    _, _, theirs = _fit_and_save(tmp_path, lib="pl")
    mine, lightnings = torch.load(ours, weights_only=True), torch.load(theirs, weights_only=True)
    assert set(lightnings) <= set(mine), set(lightnings) - set(mine)
    assert list(mine["state_dict"]) == list(lightnings["state_dict"])
    assert mine["global_step"] == lightnings["global_step"]  # (epoch: the Trainer's current_epoch in both)
    assert mine["optimizer_states"][0]["param_groups"][0]["params"] == \
        lightnings["optimizer_states"][0]["param_groups"][0]["params"]
    assert set(mine["optimizer_states"][0]["state"][0]) == set(lightnings["optimizer_states"][0]["state"][0])


def test_a_ckpt_file_resumes_exactly_and_loads_into_the_class(tmp_path):
    _, _, path = _fit_and_save(tmp_path)
    whole = _module(TrainModule)
    _trainer(tmp_path / "whole", max_steps=6, enable_checkpointing=False).fit(whole)
    resumed = _module(TrainModule)
    trainer = _trainer(tmp_path / "resumed", max_steps=6, enable_checkpointing=False)
    trainer.fit(resumed, ckpt_path=str(path))
    assert trainer.global_step == 6
    for (k, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), k  # the same steps from the same state: bit for bit
    loaded = type(resumed).load_from_checkpoint(str(path))
    assert torch.equal(loaded.net.weight, torch.load(path, weights_only=True)["state_dict"]["net.weight"])


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    _, trainer, path = _fit_and_save(tmp_path)
    before = path.read_bytes()
    with mock.patch("torch.save", side_effect=OSError(28, "No space left on device")):
        with pytest.raises(CheckpointError, match=r"model\.ckpt.*No space left on device"):
            trainer.save_checkpoint(str(path))
    assert path.read_bytes() == before and sorted(os.listdir(path.parent)) == ["model.ckpt"]


def test_one_torch_save_per_checkpoint_as_lightning(tmp_path):
    """Lightning's own tests count checkpoints by mocking torch.save."""
    _, trainer, path = _fit_and_save(tmp_path)
    with mock.patch("torch.save") as save:
        trainer.save_checkpoint(str(tmp_path / "again.ckpt"))
    assert save.call_count == 1


def test_a_ckpt_file_with_code_or_truncated_is_refused_without_running_it(tmp_path):
    _, _, path = _fit_and_save(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="model.ckpt"):
        checkpoint_io.load_meta(path)

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"format": "zerotrain.file/1", "state_dict": {}, "x": Payload()}, path)
    with pytest.raises(CheckpointError, match="safe load refuses"):  # what resuming reads through
        checkpoint_io.load_meta(path)
    with pytest.raises(CheckpointError):
        type(_module(TrainModule)).load_from_checkpoint(str(path))
    assert not (tmp_path / "pwned").exists()


def test_a_value_a_safe_load_refuses_is_named_before_anything_is_written(tmp_path):
    _, trainer, path = _fit_and_save(tmp_path)

    class Odd:
        pass

    def add(checkpoint):
        checkpoint["odd"] = Odd()

    trainer.module.on_save_checkpoint = add
    with pytest.raises(CheckpointError, match=r"would hold a value a safe load refuses: \['odd'\]"):
        trainer.save_checkpoint(str(tmp_path / "odd.ckpt"))
    assert not (tmp_path / "odd.ckpt").exists() and not (tmp_path / "odd.ckpt.tmp").exists()


def test_a_folder_of_ckpt_files_needs_no_pointer_and_last_resumes_the_newest(tmp_path):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=2, save_last=False, filename="{step}", save_top_k=-1)
    trainer = _trainer(tmp_path, max_steps=4, callbacks=[cb])
    trainer.fit(_module(TrainModule))
    assert sorted(os.listdir(tmp_path / "ck")) == ["step=2.ckpt", "step=4.ckpt"]
    assert all((tmp_path / "ck" / n).is_file() for n in os.listdir(tmp_path / "ck"))
    assert cb.latest_path == str(tmp_path / "ck" / "step=4.ckpt")
    again = _trainer(tmp_path, max_steps=5, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                                                         save_last=False)])
    again.fit(_module(TrainModule), ckpt_path="latest")
    assert again.global_step == 5  # from step 4
    # a pointer a sharded save left is kept true by the file saves after it
    checkpoint_io.write_latest(tmp_path / "ck", "step=2.ckpt")
    trainer = _trainer(tmp_path, max_steps=6, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                                                           every_n_train_steps=6, filename="{step}")])
    trainer.fit(_module(TrainModule), ckpt_path=str(tmp_path / "ck" / "step=4.ckpt"))
    assert checkpoint_io.read_latest(tmp_path / "ck").name == "step=6.ckpt"


# ---------------------------------------------------------------------------- ModelCheckpoint

@pytest.mark.parametrize("call", [
    ({"epoch": 3, "val_loss": 0.123}, {}),
    ({"epoch": 3}, {"filename": "{epoch:03d}"}),
    ({"step": 2}, {"ver": 2}),
    ({"step": 2}, {"prefix": "pre"}),
    ({}, {"filename": "{missing:d}"}),
])
@pytest.mark.parametrize("dirpath", [None, "ck"])
def test_format_checkpoint_name_is_lightnings(tmp_path, call, dirpath):
    pl = pytest.importorskip("pytorch_lightning")
    metrics, kw = call
    args = dict(dirpath=str(tmp_path / dirpath) if dirpath else None, filename="{epoch}-{val_loss:.2f}")
    ours = ModelCheckpoint(**args).format_checkpoint_name(dict(metrics), **kw)
    theirs = pl.callbacks.ModelCheckpoint(**args).format_checkpoint_name(
        {k: torch.tensor(v) for k, v in metrics.items()}, **kw)
    assert ours == theirs


@pytest.mark.parametrize("kw", [dict(save_top_k=-3), dict(every_n_train_steps=-3), dict(every_n_epochs=-3),
                                dict(mode="unknown_option"), dict(every_n_train_steps=1, every_n_epochs=2)])
def test_argument_errors_are_lightnings(kw):
    pl = pytest.importorskip("pytorch_lightning")
    with pytest.raises(Exception) as theirs:
        pl.callbacks.ModelCheckpoint(**kw)
    with pytest.raises(MisconfigurationException) as ours:
        ModelCheckpoint(**kw)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kw", [dict(monitor="val_loss"), dict(monitor="x", mode="max", every_n_train_steps=3),
                                dict(every_n_epochs=2), dict(every_n_train_steps=0, every_n_epochs=1)])
def test_state_key_is_lightnings(kw):
    pl = pytest.importorskip("pytorch_lightning")
    assert ModelCheckpoint(**kw).state_key == pl.callbacks.ModelCheckpoint(**kw).state_key


@pytest.mark.parametrize("monitor,mode", [("step", "max"), ("epoch", "max")])
def test_epoch_and_step_are_monitor_candidates(tmp_path, monitor, mode):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor=monitor, mode=mode, save_top_k=1, save_last=False,
                         filename="{step}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not find the monitored key"
        _trainer(tmp_path, max_epochs=2, callbacks=[cb]).fit(_module(TrainModule))
    assert os.path.basename(cb.best_model_path) == "step=8.ckpt" and cb.best_model_score == (8 if monitor == "step"
                                                                                               else 1)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_current_score_and_nan_as_the_worst(tmp_path, mode):
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="nan", mode=mode, save_top_k=1, save_last=False)
    module = _module(TrainModule, log="nan")
    _trainer(tmp_path, max_epochs=1, callbacks=[cb]).fit(module)
    want = float("inf") if mode == "min" else float("-inf")
    assert cb.current_score == want and cb.best_model_score == want


def test_its_state_in_the_checkpoint_has_lightnings_keys_and_to_yaml(tmp_path):
    import yaml

    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"), monitor="loss", save_top_k=2, save_last=False)
    _trainer(tmp_path, max_epochs=3, callbacks=[cb]).fit(_module(TrainModule, log="loss"))
    saved = [torch.load(tmp_path / "ck" / name, weights_only=True) for name in os.listdir(tmp_path / "ck")]
    for ckpt in saved:
        assert {"monitor", "best_model_score", "best_model_path", "current_score", "dirpath", "best_k_models",
                "kth_best_model_path", "last_model_path"} <= set(ckpt["callbacks"][cb.state_key])
    newest = max(saved, key=lambda c: c["global_step"])["callbacks"][cb.state_key]
    assert newest["current_score"] == cb.current_score
    cb.to_yaml()
    with open(tmp_path / "ck" / "best_k_models.yaml") as f:
        assert yaml.safe_load(f) == cb.best_k_models


# ---------------------------------------------------------------------------- load_from_checkpoint

@pytest.mark.parametrize("map_location", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"},
                                          lambda storage, loc: storage, lambda storage, loc: None])
def test_load_from_checkpoint_takes_torch_loads_map_locations(tmp_path, map_location):
    _, _, path = _fit_and_save(tmp_path)
    loaded = type(_module(TrainModule)).load_from_checkpoint(str(path), map_location=map_location)
    assert loaded.device.type == "cpu"
    assert torch.equal(loaded.net.weight, torch.load(path, weights_only=True)["state_dict"]["net.weight"])


@pytest.mark.parametrize("strict,strict_loading", [(s, sl) for s in (None, True, False) for sl in (None, True, False)])
def test_strict_and_strict_loading_as_lightning(tmp_path, strict, strict_loading):
    pl = pytest.importorskip("pytorch_lightning")
    outcome = {}
    for lib, base in (("ours", TrainModule), ("pl", pl.LightningModule)):
        module, _, path = _fit_and_save(tmp_path, lib=lib)
        cls = type(module)
        calls = []

        def load_state_dict(self, state, strict=True, **kw):
            calls.append(strict)
            return torch.nn.Module.load_state_dict(self, state, strict=strict)

        class Loading(cls):
            def __init__(self, width: int = 3):
                super().__init__(width)
                if strict_loading is not None:
                    self.strict_loading = strict_loading

        Loading.load_state_dict = load_state_dict
        try:
            Loading.load_from_checkpoint(str(path), strict=strict)
            outcome[lib] = calls
        except ValueError as exc:
            outcome[lib] = str(exc).replace("Loading", "M")
    assert outcome["ours"] == outcome["pl"]


def test_an_empty_state_dict_warns_as_lightning(tmp_path):
    _, _, path = _fit_and_save(tmp_path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["state_dict"] = {}
    torch.save(ckpt, path)
    with pytest.warns(UserWarning, match="contains no parameters"):
        type(_module(TrainModule)).load_from_checkpoint(path, strict=False)


def test_a_ckpt_path_that_is_not_there_is_lightnings_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found") as info:
        _trainer(tmp_path, max_steps=1).fit(_module(TrainModule), ckpt_path=str(tmp_path / "non_existing.ckpt"))
    assert isinstance(info.value, CheckpointError)  # still a CheckpointError too


def test_best_model_path_without_monitor_is_the_newest_save(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    paths = {}
    for lib, base, cls in (("ours", TrainModule, ModelCheckpoint), ("pl", pl.LightningModule,
                                                                     pl.callbacks.ModelCheckpoint)):
        cb = cls(dirpath=str(tmp_path / lib), every_n_train_steps=2, save_last=False, filename="{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(tmp_path, lib, max_steps=4, callbacks=[cb]).fit(_module(base))
        paths[lib] = os.path.basename(cb.best_model_path)
    assert paths["ours"] == paths["pl"] == "step=4.ckpt"


def test_save_checkpoint_has_lightnings_signature(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    import inspect

    ours = list(inspect.signature(Trainer.save_checkpoint).parameters)[:4]
    assert ours == list(inspect.signature(pl.Trainer.save_checkpoint).parameters)[:4]
    _, trainer, path = _fit_and_save(tmp_path)
    with pytest.raises(TypeError, match=r"storage_options=...\)` with `storage_options` arg is not supported"):
        trainer.save_checkpoint(str(path), False, "options")
    trainer.save_checkpoint(str(tmp_path / "w.ckpt"), True)  # weights_only (not update_latest): Lightning's file
    assert "optimizer_states" not in torch.load(tmp_path / "w.ckpt", weights_only=True)


def test_model_checkpoints_signature_has_real_types_for_the_cli():
    """LightningCLI builds ModelCheckpoint's arguments from its signature (save_last: bool | str | None)."""
    import inspect

    params = inspect.signature(ModelCheckpoint).parameters
    assert not any(isinstance(p.annotation, str) for p in params.values())
    assert params["save_last"].annotation == (bool | str | None)


def test_hooks_take_lightnings_keywords_and_dirpath_expands_home(tmp_path):
    cb = ModelCheckpoint(dirpath="~/checkpoints")
    assert cb.dirpath == os.path.expanduser("~/checkpoints")
    cb = ModelCheckpoint(dirpath=str(tmp_path))
    trainer = _trainer(tmp_path, max_steps=1)
    cb.setup(trainer=trainer, pl_module=None, stage="fit")  # Lightning's keyword names
