"""A TrainModule's Trainer and Fabric references and Fabric-based logging as Lightning's
core/test_lightning_module.py expects (issue 41): ``trainer``/``fabric`` set on an ensemble reach
its member modules (the Fabric weakly held), ``Fabric.setup(model)`` without an optimizer gives the
model alone (single/ddp), and ``self.log``/``self.log_dict`` of a module set up by a Fabric go to
the Fabric's loggers, refusing what Lightning refuses."""
from __future__ import annotations

import weakref
from unittest.mock import Mock

import pytest
import torch

from zerotrain import TrainModule
from zerotrain.demos.boring_classes import BoringModel
from zerotrain.fabric import Fabric


def test_trainer_and_fabric_reach_the_member_modules():
    ensemble, inner = TrainModule(), TrainModule()
    ensemble.inner = inner
    with pytest.raises(RuntimeError, match="attached to a `Trainer"):
        _ = ensemble.trainer
    trainer, fabric = Mock(), Mock()
    ensemble.trainer = trainer
    assert inner.trainer is trainer
    assert inner._fabric is None and inner.fabric is None
    ensemble.fabric = fabric
    assert ensemble.fabric is inner.fabric and inner.fabric is weakref.proxy(fabric)


def test_a_module_set_up_by_a_fabric_logs_through_it():
    logger = Mock()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    module = fabric.setup(BoringModel())  # no optimizer: the model alone, as Fabric's
    assert module.logger is logger and module.loggers == [logger]
    module.log("int", 1)
    logger.log_metrics.assert_called_with(metrics={"int": 1}, step=None)
    module.log_dict({"a": 1, "b": torch.tensor(0.5)})
    logger.log_metrics.assert_called_with(metrics={"a": 1, "b": 0.5}, step=None)
    logger.reset_mock()
    module.log("nothing", 1, logger=False)
    logger.log_metrics.assert_not_called()
    with pytest.raises(ValueError, match="`list` values cannot be logged"):
        module.log("invalid", [])
    with pytest.raises(ValueError, match="nested dictionaries cannot be logged"):
        module.log_dict({"nested": {"nested": 1}})
    with pytest.raises(IndexError):
        _ = Fabric(accelerator="cpu", devices=1).setup(BoringModel()).logger


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_module_set_up_by_a_fabric_clips_through_it(algorithm):
    from zerotrain.utilities import GradClipAlgorithmType

    fabric = Fabric(accelerator="cpu", devices=1)
    original = BoringModel()
    module = fabric.setup(original)
    fabric.clip_gradients = Mock()
    optimizer = Mock()
    module.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm=GradClipAlgorithmType(algorithm))
    by_value = algorithm == "value"
    fabric.clip_gradients.assert_called_once_with(original, optimizer, clip_val=1e-3 if by_value else None,
                                                  max_norm=None if by_value else 1e-3)
