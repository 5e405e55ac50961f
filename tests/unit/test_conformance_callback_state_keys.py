"""A callback subclass's state is saved under its own class name, as Lightning's (issue 41;
callbacks/test_early_stopping.py::test_resume_early_stopping_from_checkpoint reads
``checkpoint["callbacks"]["EarlyStoppingTestRestore{'monitor': ..., 'mode': ...}"]``)."""
from __future__ import annotations

import pytest

from zerotrain.callbacks import EarlyStopping

pytestmark = pytest.mark.timeout(60)


class EarlyStoppingSubclass(EarlyStopping):
    pass


def test_early_stopping_state_key_names_the_subclass():
    assert EarlyStopping(monitor="val_loss").state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    assert EarlyStoppingSubclass(monitor="m", mode="max").state_key == \
        "EarlyStoppingSubclass{'monitor': 'm', 'mode': 'max'}"


def test_the_same_keys_as_lightning():
    pl = pytest.importorskip("pytorch_lightning")

    def subclass(base):
        class Sub(base):
            pass
        return Sub

    for ours, theirs in [(EarlyStopping, pl.callbacks.EarlyStopping),
                         (subclass(EarlyStopping), subclass(pl.callbacks.EarlyStopping))]:
        assert ours(monitor="loss", mode="max").state_key == theirs(monitor="loss", mode="max").state_key
