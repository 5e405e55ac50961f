"""The module's hooks as Lightning's own tests (models/test_hooks.py) expect them (issue 41): the
model's mode around an evaluation (``on_<stage>_model_eval``/``_train``, every submodule's mode put
back), the batch transfer hooks (the datamodule's where it overrides them), ``setup``/``teardown``
given the stage by keyword, no ``configure_optimizers`` outside ``fit`` on a replicated strategy,
no data requested for a stage limited to 0 batches, ``strategy.root_device``, Lightning's
``strategy.connect(model)`` and ``strategy.on_exception``."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from zerotrain import Callback, DataModule, Trainer
from zerotrain.demos.boring_classes import BoringDataModule, BoringModel, RandomDataset


def _trainer(tmp_path, **kw):
    opts = dict(default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    opts.update(kw)
    return Trainer(**opts)


class Frozen(BoringModel):
    """A submodule frozen in eval mode must stay so through training and evaluation."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(2, 2).eval()
        self.modes = []

    def training_step(self, batch, batch_idx):
        self.modes.append(("train", self.layer.training, self.frozen.training))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.modes.append(("val", self.layer.training, self.frozen.training))
        return super().validation_step(batch, batch_idx)


def test_every_submodules_mode_is_put_back_after_validation(tmp_path):
    model = Frozen()
    _trainer(tmp_path, num_sanity_val_steps=1).fit(model)
    assert set(model.modes) == {("train", True, False), ("val", False, False)}
    assert model.training and not model.frozen.training


def test_model_eval_and_train_hooks_are_called(tmp_path):
    calls = []

    class Hooked(BoringModel):
        def on_validation_model_eval(self):
            calls.append("eval")
            super().on_validation_model_eval()

        def on_validation_model_train(self):  # overridden: called instead of the modes being put back
            calls.append("train")

        def on_validation_model_zero_grad(self):
            calls.append("zero_grad")
            super().on_validation_model_zero_grad()

    model = Hooked()
    _trainer(tmp_path, num_sanity_val_steps=1).fit(model)
    assert calls == ["eval", "train", "zero_grad", "eval", "train"]  # the sanity check has no zero_grad
    assert not model.training  # nothing put the module back in train mode: the override did not


def test_batch_transfer_hooks_in_order_and_the_datamodules_first(tmp_path):
    calls = []

    class Model(BoringModel):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            calls.append(("module.before", dataloader_idx))
            return batch

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            calls.append(("module.transfer", device.type, dataloader_idx))
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append(("module.after", dataloader_idx))
            return batch * 0

        def training_step(self, batch, batch_idx):
            assert not batch.any()  # on_after_batch_transfer's batch reaches the step
            return super().training_step(batch, batch_idx)

    class Data(BoringDataModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            calls.append(("dm.before", dataloader_idx))
            return batch

    _trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(Model(), datamodule=Data())
    assert calls == [("dm.before", 0), ("module.transfer", "cpu", 0), ("module.after", 0)]


def test_setup_and_teardown_get_the_stage_by_keyword(tmp_path):
    seen = []

    class Cb(Callback):
        def setup(self, trainer, pl_module, **kw):
            seen.append(("cb.setup", kw))

        def teardown(self, trainer, pl_module, **kw):
            seen.append(("cb.teardown", kw))

    class Model(BoringModel):
        def setup(self, **kw):
            seen.append(("setup", kw))

    class Data(BoringDataModule):
        def setup(self, **kw):
            seen.append(("dm.setup", kw))
            super().setup(**kw)

    _trainer(tmp_path, callbacks=[Cb()]).validate(Model(), datamodule=Data(), verbose=False)
    assert seen == [("dm.setup", {"stage": "validate"}), ("cb.setup", {"stage": "validate"}),
                    ("setup", {"stage": "validate"}), ("cb.teardown", {"stage": "validate"})]


class NoOptimizers(torch.nn.Module):
    pass


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_no_configure_optimizers_outside_fit(tmp_path, fn):
    """As Lightning: evaluating asks for no optimizer; a later fit on the same Trainer does."""
    asked = []

    class Model(BoringModel):
        def configure_optimizers(self):
            asked.append(self.trainer.state.fn)
            return super().configure_optimizers()

    model, trainer = Model(), _trainer(tmp_path)
    getattr(trainer, fn)(model, **({} if fn == "predict" else {"verbose": False}))
    assert asked == [] and trainer.optimizers == []
    trainer.fit(model)
    assert asked == ["fit"] and len(trainer.optimizers) == 1


def test_predict_without_configure_optimizers(tmp_path):
    class Model(torch.nn.Module):
        pass

    from zerotrain import TrainModule

    class Forward(TrainModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(32, 2)

        def forward(self, x):
            return self.layer(x)

    out = _trainer(tmp_path).predict(Forward(), DataLoader(RandomDataset(32, 2)))
    assert len(out) == 2 and out[0].shape == (1, 2)


def test_a_stage_limited_to_zero_batches_requests_no_data(tmp_path):
    class Model(BoringModel):
        def val_dataloader(self):
            raise AssertionError("requested")

    assert _trainer(tmp_path, limit_val_batches=0).validate(Model(), verbose=False) == []


def test_strategy_root_device_connect_and_on_exception(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.strategy.root_device == torch.device("cpu")
    model = BoringModel()
    trainer.strategy.connect(model)  # Lightning's one-argument form
    assert trainer.strategy.module is model

    class Raises(BoringModel):
        def on_fit_start(self):
            raise RuntimeError("boom")

    trainer = _trainer(tmp_path)
    with mock.patch("zerotrain.strategies.strategy.Strategy.on_exception") as on_exception:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(Raises())
    assert [c.args[0].args for c in on_exception.call_args_list] == [("boom",)]


def test_datamodule_state_is_saved_under_its_qualified_name_and_given_back(tmp_path):
    class Data(BoringDataModule):
        loaded = None

        def state_dict(self):
            return {"my": "state"}

        def load_state_dict(self, state_dict):
            self.loaded = state_dict

    trainer = _trainer(tmp_path)
    trainer.fit(BoringModel(), datamodule=Data())
    path = str(tmp_path / "dm.ckpt")
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)[Data.__qualname__] == {"my": "state"}
    dm = Data()
    _trainer(tmp_path, max_epochs=2).fit(BoringModel(), datamodule=dm, ckpt_path=path)
    assert dm.loaded == {"my": "state"}


def test_datamodule_as_lightnings_str_and_from_datasets():
    dm = BoringDataModule()
    assert str(dm) == os.linesep.join(f"{{{t} dataloader: None}}" for t in ("Train", "Validation", "Test", "Predict"))
    dm.setup("fit")
    assert str(dm).split(os.linesep)[:2] == ["{Train dataloader: size=64}", "{Validation dataloader: size=64}"]
    ds = RandomDataset(32, 4)
    dm = DataModule.from_datasets(ds, batch_size=2)
    with mock.patch("zerotrain.trainer.api.datamodule.DataLoader") as loader:
        dm.train_dataloader()
    loader.assert_called_once_with(ds, batch_size=2, num_workers=0, pin_memory=True, shuffle=True)
    from zerotrain.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="`val_dataloader` must be implemented"):
        dm.val_dataloader()
