"""Trainer arguments and methods as Lightning's trainer/test_trainer.py expects (issue 41):
``gradient_clip_val``/``gradient_clip_algorithm`` refused in Lightning's words (a TypeError for a
value that is no number; the algorithm in any case), ``save_checkpoint`` before any model is
Lightning's AttributeError, and ``Trainer.init_module()`` builds on this rank's device in a
"-true" precision's dtype."""
from __future__ import annotations

import pytest
import torch

from zerotrain import Trainer
from zerotrain.demos.boring_classes import BoringModel
from zerotrain.trainer.errors import MisconfigurationException


def test_gradient_clip_value_that_is_no_number_is_a_type_error():
    with pytest.raises(TypeError, match="`gradient_clip_val` should be an int or a float"):
        Trainer(gradient_clip_val=(1, 2), logger=False)


def test_gradient_clip_algorithm_in_lightnings_words_and_any_case():
    with pytest.raises(MisconfigurationException, match="`gradient_clip_algorithm` norm2 is invalid"):
        Trainer(gradient_clip_algorithm="norm2", logger=False)
    assert Trainer(gradient_clip_algorithm="VALUE", logger=False).gradient_clip_algorithm == "value"


def test_save_checkpoint_without_a_model(tmp_path):
    trainer = Trainer(default_root_dir=str(tmp_path), logger=False)
    assert trainer.model is None
    with pytest.raises(AttributeError, match="Saving a checkpoint is only possible if a model is attached"):
        trainer.save_checkpoint(str(tmp_path / "x.ckpt"))


@pytest.mark.parametrize(("precision", "dtype"), [("32", torch.float32), ("bf16-true", torch.bfloat16)])
def test_init_module_builds_on_the_device_in_the_precisions_dtype(precision, dtype):
    trainer = Trainer(accelerator="cpu", devices=1, precision=precision, logger=False)
    with trainer.init_module():
        model = BoringModel()
    assert model.device == torch.device("cpu") and model.dtype == dtype
    assert torch.get_default_dtype() == torch.float32  # put back


def test_node_rank_is_the_process_nodes():
    trainer = Trainer(logger=False)
    assert trainer.node_rank == 0 == trainer.strategy.info.node_rank
