"""Hyperparameters as Lightning's own tests (models/test_hparams.py) expect them (issue 41): the
classes' ``CHECKPOINT_HYPER_PARAMS_*`` keys, ``load_from_checkpoint(hparams_file=, weights_only=)``
on the module and the datamodule, a DictConfig coming back as one, Lightning's warnings for an
``nn.Module`` hyperparameter and an unpicklable one, and its message for a primitive."""
from __future__ import annotations

import pathlib

import pytest
import torch

from zerotrain import DataModule, Trainer, TrainModule
from zerotrain.core.saving import save_hparams_to_tags_csv, save_hparams_to_yaml
from zerotrain.demos.boring_classes import BoringDataModule, BoringModel
from zerotrain.trainer.api.from_checkpoint import read_checkpoint


class Model(BoringModel):
    def __init__(self, hparams=None, width=3, **kwargs):
        super().__init__()
        self.save_hyperparameters(hparams) if hparams is not None else self.save_hyperparameters()


class Data(BoringDataModule):
    def __init__(self, hparams):
        super().__init__()
        self.save_hyperparameters(hparams)


def _fit(tmp_path, model, datamodule=None) -> str:
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, limit_val_batches=0, logger=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    path = str(tmp_path / "model.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_checkpoint_key_names_are_lightnings():
    pl = pytest.importorskip("pytorch_lightning")
    for ours, theirs in ((TrainModule, pl.LightningModule), (DataModule, pl.LightningDataModule)):
        for name in ("CHECKPOINT_HYPER_PARAMS_KEY", "CHECKPOINT_HYPER_PARAMS_NAME", "CHECKPOINT_HYPER_PARAMS_TYPE"):
            assert getattr(ours, name) == getattr(theirs, name), (ours, name)


def test_datamodule_load_from_checkpoint_rebuilds_it_from_its_hparams(tmp_path):
    path = _fit(tmp_path, BoringModel(), Data({"test_arg": 14}))
    data = Data.load_from_checkpoint(path)
    assert isinstance(data, Data) and data.hparams.test_arg == 14
    assert Data.load_from_checkpoint(path, weights_only=True).hparams.test_arg == 14


def test_hparams_file_replaces_the_saved_hparams(tmp_path):
    path = _fit(tmp_path, Model(width=3))
    save_hparams_to_yaml(tmp_path / "h.yaml", {"width": 7})
    save_hparams_to_tags_csv(tmp_path / "h.csv", {"width": 9})
    assert Model.load_from_checkpoint(path, weights_only=False).hparams.width == 3
    assert Model.load_from_checkpoint(path, hparams_file=tmp_path / "h.yaml").hparams.width == 7
    assert Model.load_from_checkpoint(path, hparams_file=str(tmp_path / "h.csv")).hparams.width == 9
    with pytest.raises(ValueError, match=r"\.csv, \.yml or \.yaml is required for `hparams_file`"):
        Model.load_from_checkpoint(path, hparams_file=tmp_path / "h.json")


def test_a_dictconfig_comes_back_as_one_with_its_nested_values(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    conf = omegaconf.OmegaConf.create({"test_arg": 14, "mylist": [15.4, {"a": 1, "b": 2}]})
    path = _fit(tmp_path, Model(hparams=conf))
    loaded = Model.load_from_checkpoint(path)
    assert isinstance(loaded.hparams, omegaconf.Container)
    assert loaded.hparams.test_arg == 14 and loaded.hparams.mylist[1].b == 2
    assert read_checkpoint(path)["hparams_type"] == "DictConfig"


def test_an_nn_module_hparam_warns_as_lightning():
    class WithLoss(BoringModel):
        def __init__(self, loss=torch.nn.CrossEntropyLoss()):
            super().__init__()
            self.save_hyperparameters()

    with pytest.warns(UserWarning, match=r"Attribute 'loss' is an instance of `nn.Module` and is already saved during "
                                         r"checkpointing. It is recommended to ignore them using "
                                         r"`self.save_hyperparameters\(ignore=\['loss'\]\)`"):
        WithLoss()


def test_an_unpicklable_hparam_is_dropped_when_a_stage_starts(tmp_path):
    class Unpicklable(BoringModel):
        def __init__(self, foo="bar", fn=(lambda x: x + 1)):
            super().__init__()
            self.save_hyperparameters()

    model = Unpicklable()
    assert "fn" in model.hparams
    with pytest.warns(UserWarning, match="Attribute 'fn' removed from hparams because it cannot be pickled"):
        _fit(tmp_path, model)
    assert "fn" not in model.hparams and model.hparams.foo == "bar"


@pytest.mark.parametrize("value", [42, 3.14, True])
def test_a_primitive_config_is_refused_with_lightnings_message(value):
    class One(BoringModel):
        def __init__(self, config):
            super().__init__()
            self.save_hyperparameters(config)

    with pytest.raises(ValueError, match=r"Primitives \(<class 'bool'>"):
        One(value)


def test_lightning_reads_the_hparams_zerotrain_saved(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.demos.boring_classes import BoringModel as PLBoring

    class Theirs(PLBoring):
        def __init__(self, hparams=None, width=3, **kwargs):
            super().__init__()
            self.save_hyperparameters(hparams) if hparams is not None else self.save_hyperparameters()

    path = _fit(tmp_path, Model(width=5))
    if not pathlib.Path(path).is_file():
        pytest.skip("this strategy saves a sharded checkpoint folder, which Lightning's loader does not read")
    assert Theirs.load_from_checkpoint(path, weights_only=True).hparams.width == 5
    assert pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY in torch.load(path, weights_only=True)


def test_a_dataclass_module_saves_its_init_fields():
    import dataclasses

    @dataclasses.dataclass(eq=False)
    class DataClassModel(BoringModel):
        mandatory: int
        optional: str = "optional"
        ignore_me: bool = False
        derived: int = dataclasses.field(default=999, init=False)

        def __post_init__(self):
            super().__init__()
            self.save_hyperparameters(ignore=("ignore_me",))

    model = DataClassModel(33, optional="cocofruit")
    assert model.hparams == {"mandatory": 33, "optional": "cocofruit"} and model.derived == 999


def test_an_enum_hparam_is_written_to_yaml_by_its_name(tmp_path):
    import enum

    from zerotrain.core.saving import load_hparams_from_yaml

    class Options(str, enum.Enum):
        option1name = "option1val"

    save_hparams_to_yaml(tmp_path / "h.yaml", {"opt": Options.option1name, "n": 1})
    assert load_hparams_from_yaml(tmp_path / "h.yaml", use_omegaconf=False) == {"opt": "option1name", "n": 1}
