"""``load_from_checkpoint`` as Lightning's models/test_hparams.py expects (issue 41): a module's
hyperparameters under the keys of Lightning before 1.0 (``hparams``, ``module_arguments``) are
read, under the current key's; building the class from them failing is Lightning's TypeError."""
from __future__ import annotations

import pytest
import torch

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel


class WithArgs(BoringModel):
    def __init__(self, batch_size=64):
        super().__init__()
        self.save_hyperparameters()


class Positional(BoringModel):
    def __init__(self, hparams):
        super().__init__()
        self._hparams = hparams  # kept as hyperparameters without save_hyperparameters


class VarArgs(Positional):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def _checkpoint(tmp_path, model):
    trainer = Trainer(default_root_dir=str(tmp_path), max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(model)
    path = str(tmp_path / "m.ckpt")
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("past_key", ["hparams", "module_arguments"])
def test_hyperparameters_under_a_past_key(tmp_path, past_key):
    path = _checkpoint(tmp_path, WithArgs())
    raw = torch.load(path, weights_only=True)
    raw[past_key] = dict(raw.pop("hyper_parameters"), batch_size=-17)
    torch.save(raw, path)
    assert WithArgs.load_from_checkpoint(path).hparams.batch_size == -17


def test_a_class_that_cannot_take_its_hyperparameters_is_a_type_error(tmp_path):
    path = _checkpoint(tmp_path, VarArgs({"test": 1}))
    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'test'"):
        VarArgs.load_from_checkpoint(path)
