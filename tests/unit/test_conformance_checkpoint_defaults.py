"""ModelCheckpoint's defaults and rules as Lightning's (issue 41), compared with
pytorch-lightning 2.6 where it is installed: the files a fit leaves in ``dirpath`` (names
``epoch={epoch}-step={step}``, a save every epoch, only the newest kept without ``monitor``,
``last.ckpt`` after each save and ``last-vN`` when taken, ``every_n_epochs=0``,
``save_top_k=0``, ``train_time_interval``), ``_find_last_checkpoints``, a settable
``best_model_path``, and ``ckpt_path`` None / "best" / "last" in the evaluation stages.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from zerotrain import Trainer, TrainModule
from zerotrain.callbacks import ModelCheckpoint

pytestmark = pytest.mark.timeout(180)


def _module(base):
    torch.manual_seed(0)

    class Model(base):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.layer(batch[0]).pow(2).mean())

        test_step = validation_step

        def forward(self, x):
            return self.layer(x)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)

        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)

        test_dataloader = predict_dataloader = val_dataloader

    return Model()


def _fit(lib, root, runs=1, trainer_kw=None, **checkpoint):
    """The names in ``root/ck`` after ``runs`` fits (a new Trainer each), and the last callback."""
    common = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, max_epochs=3, limit_train_batches=2, default_root_dir=str(root),
                  **(trainer_kw or {}))
    for _ in range(runs):
        if lib == "pl":
            pl = pytest.importorskip("pytorch_lightning")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cb = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ck"), **checkpoint)
                pl.Trainer(callbacks=[cb], **common).fit(_module(pl.LightningModule))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cb = ModelCheckpoint(dirpath=str(root / "ck"), **checkpoint)
                Trainer(callbacks=[cb], stall_timeout_s=None, **common).fit(_module(TrainModule))
    names = sorted(os.listdir(root / "ck")) if (root / "ck").exists() else []
    return names, cb


CASES = {
    "defaults": {},
    "save_last": dict(save_last=True),
    "link": dict(save_last="link"),
    "all": dict(save_top_k=-1),
    "none": dict(save_top_k=0, save_last=True),
    "never": dict(every_n_epochs=0, save_last=True),
    "every_2": dict(every_n_epochs=2, save_top_k=-1),
    "steps": dict(every_n_train_steps=4, save_top_k=-1),
    "monitor": dict(monitor="val_loss", save_top_k=2, save_last=True),
    "template": dict(filename="{epoch:02d}", save_top_k=-1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_files_a_fit_leaves_are_lightnings(tmp_path, case):
    ours, cb = _fit("ours", tmp_path / "ours", **CASES[case])
    if case == "defaults":  # without pytorch-lightning: what Lightning's documentation says
        assert ours == ["epoch=2-step=6.ckpt"] and cb.best_model_path.endswith("epoch=2-step=6.ckpt")
    theirs, their_cb = _fit("pl", tmp_path / "pl", **CASES[case])
    assert ours == theirs
    assert os.path.basename(cb.best_model_path) == os.path.basename(their_cb.best_model_path)
    assert os.path.basename(cb.last_model_path) == os.path.basename(their_cb.last_model_path)


def test_reruns_into_one_folder_get_lightnings_versions(tmp_path):
    ours, _ = _fit("ours", tmp_path / "ours", runs=2, save_last=True)
    assert ours == ["epoch=2-step=6-v1.ckpt", "epoch=2-step=6.ckpt", "last-v1.ckpt", "last.ckpt"]
    assert _fit("pl", tmp_path / "pl", runs=2, save_last=True)[0] == ours


def test_train_time_interval_saves_after_the_batch_it_elapses(tmp_path):
    ours, _ = _fit("ours", tmp_path, train_time_interval=timedelta(0), save_top_k=-1)
    assert ours == [f"epoch={e}-step={s}.ckpt" for e, s in ((0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6))]


def test_find_last_checkpoints_and_a_settable_best_model_path(tmp_path):
    for name in ("last.ckpt", "last-v1.ckpt", "last-3.ckpt", "lastly.pt", "epoch=0.ckpt", "notlast.ckpt"):
        (tmp_path / name).touch()
    cb = ModelCheckpoint(dirpath=str(tmp_path))
    assert {os.path.basename(p) for p in cb._find_last_checkpoints(None)} == {"last.ckpt", "last-v1.ckpt",
                                                                              "last-3.ckpt"}
    cb.best_model_path = "x.ckpt"
    assert cb.best_model_path == "x.ckpt" and ModelCheckpoint().best_model_path == ""
    assert cb.format_checkpoint_name({"step": 3}) == str(tmp_path / "epoch=0-step=3.ckpt")


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_ckpt_path_in_the_evaluation_stages_is_lightnings(tmp_path, fn):
    model = _module(TrainModule)
    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              max_epochs=1, limit_train_batches=2, default_root_dir=str(tmp_path), stall_timeout_s=None)
    trainer = Trainer(callbacks=[ModelCheckpoint(save_last=False), ModelCheckpoint(dirpath=str(tmp_path / "b"))],
                      **kw)
    trainer.fit(model)
    assert trainer.ckpt_path is None
    run = getattr(trainer, fn)
    with pytest.warns(UserWarning, match="The best model of the previous `fit` call will be used"):
        run()
    assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path != ""
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint`"):
        run(ckpt_path="best")
    with pytest.warns(UserWarning, match="there is no last checkpoint available"):
        run(ckpt_path="last")
    assert trainer.ckpt_path is None
    run(model, ckpt_path=None)
    assert trainer.ckpt_path is None
    untrained = Trainer(callbacks=[ModelCheckpoint(save_top_k=0)], **kw)
    with pytest.raises(ValueError, match="is not configured to save the best model"):
        getattr(untrained, fn)(model, ckpt_path="best")


@pytest.mark.parametrize("fn, ckpt_path", [("fit", None), ("fit", "last"), ("validate", None), ("validate", "last")])
def test_parse_ckpt_path_with_an_on_exception_checkpoint_is_lightnings(tmp_path, fn, ckpt_path):
    """Lightning's ``trainer._checkpoint_connector._parse_ckpt_path``: in fit, None means "last"
    (said), and an OnExceptionCheckpoint's file is a "last" candidate; elsewhere None means "best"."""
    from zerotrain.callbacks import OnExceptionCheckpoint

    def parse(lib):
        mod = pytest.importorskip("pytorch_lightning") if lib == "pl" else None
        mc = (mod.callbacks.ModelCheckpoint if mod else ModelCheckpoint)()
        mc.best_model_path = "foobar"
        ft = (mod.callbacks.OnExceptionCheckpoint if mod else OnExceptionCheckpoint)(str(tmp_path / lib))
        os.makedirs(ft.dirpath, exist_ok=True)
        open(ft.ckpt_path, "w").close()
        trainer = (mod.Trainer if mod else Trainer)(callbacks=[mc, ft], logger=False)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            state_fn = mod.trainer.states.TrainerFn(fn) if mod else fn
            trainer.state.fn = state_fn  # as upstream's test: Lightning reads the running stage from the state
            out = trainer._checkpoint_connector._parse_ckpt_path(state_fn, ckpt_path, model_provided=fn == "fit",
                                                                 model_connected=True)
        return os.path.basename(out), [str(w.message) for w in said if "ckpt_path=None" in str(w.message)]

    ours = parse("ours")
    assert ours[0] == ("foobar" if (fn, ckpt_path) == ("validate", None) else "on_exception.ckpt")
    assert ours == parse("pl")


def test_hpc_save_path_numbers_as_lightning(tmp_path):
    connector = Trainer(logger=False)._checkpoint_connector
    assert connector.hpc_save_path(str(tmp_path)) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_4.ckpt").touch()
    assert connector.hpc_save_path(str(tmp_path)) == str(tmp_path / "hpc_ckpt_5.ckpt")


def test_checkpoint_callbacks_come_last_as_in_lightning(tmp_path):
    from zerotrain.callbacks import EarlyStopping

    ours = Trainer(callbacks=[ModelCheckpoint(), EarlyStopping(monitor="x")], logger=False).callbacks
    assert type(ours[0]).__name__ == "EarlyStopping" and type(ours[-1]).__name__ == "ModelCheckpoint"
    pl = pytest.importorskip("pytorch_lightning")
    theirs = pl.Trainer(callbacks=[pl.callbacks.ModelCheckpoint(), pl.callbacks.EarlyStopping(monitor="x")],
                        logger=False).callbacks
    assert type(theirs[0]).__name__ == "EarlyStopping" and type(theirs[-1]).__name__ == "ModelCheckpoint"


def test_manual_optimization_with_a_step_trigger_warns_as_lightning(tmp_path):
    def manual(base):
        model = _module(base)
        model.automatic_optimization = False

        def training_step(batch, batch_idx):
            opt = model.optimizers()
            opt.zero_grad()
            model.manual_backward(model.layer(batch[0]).pow(2).mean())
            opt.step()

        model.training_step = training_step
        return model

    for lib in ("ours", "pl"):
        mod = pytest.importorskip("pytorch_lightning") if lib == "pl" else None
        kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  max_steps=2, default_root_dir=str(tmp_path / lib))
        cb = (mod.callbacks.ModelCheckpoint if mod else ModelCheckpoint)(dirpath=str(tmp_path / lib),
                                                                          every_n_train_steps=1)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            (mod.Trainer(callbacks=[cb], **kw) if mod else Trainer(callbacks=[cb], stall_timeout_s=None, **kw)).fit(
                manual(mod.LightningModule if mod else TrainModule))
        assert any("The checkpoint will contain the model state AFTER optimization" in str(w.message) for w in said)


def test_dump_checkpoint_and_the_save_call_are_lightnings(tmp_path):
    from unittest import mock

    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"))
    trainer = Trainer(callbacks=[cb], logger=False, enable_progress_bar=False, max_epochs=1, limit_train_batches=2,
                      default_root_dir=str(tmp_path), stall_timeout_s=None)
    with mock.patch.object(Trainer, "save_checkpoint", autospec=True) as save:
        trainer.fit(_module(TrainModule))
    assert save.call_args_list == [mock.call(trainer, str(tmp_path / "ck" / "epoch=0-step=2.ckpt"), False)]
    trainer = Trainer(logger=False, enable_progress_bar=False, max_epochs=1, limit_train_batches=2,
                      default_root_dir=str(tmp_path), stall_timeout_s=None)
    trainer.fit(_module(TrainModule))
    dumped = trainer._checkpoint_connector.dump_checkpoint()
    assert {"epoch", "global_step", "state_dict", "optimizer_states", "callbacks", "loops"} <= set(dumped)
    assert dumped["global_step"] == 2 and not [p for p in os.listdir(tempfile.gettempdir()) if
                                               p.startswith("dump_checkpoint-")]


def test_resuming_without_a_callback_whose_state_was_saved_warns_as_lightning(tmp_path):
    from zerotrain.callbacks import Callback

    class Stateful(Callback):
        def state_dict(self):
            return {"a": 1}

    kw = dict(logger=False, enable_progress_bar=False, limit_train_batches=2, default_root_dir=str(tmp_path),
              stall_timeout_s=None)
    cb = ModelCheckpoint(dirpath=str(tmp_path / "ck"))
    Trainer(callbacks=[cb, Stateful()], max_epochs=1, **kw).fit(_module(TrainModule))
    with pytest.warns(UserWarning, match=r"Please add the following callbacks: \[.*Stateful'\]"):
        Trainer(max_epochs=2, **kw).fit(_module(TrainModule), ckpt_path=cb.best_model_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        Trainer(callbacks=[Stateful(), ModelCheckpoint(dirpath=str(tmp_path / "ck"))], max_epochs=2,
                **kw).fit(_module(TrainModule), ckpt_path=cb.best_model_path)
    assert not [w for w in said if "Please add the following callbacks" in str(w.message)]  # all there
