"""An unknown Trainer argument is Python's TypeError in Python's words for a call,
``Trainer.__init__() got an unexpected keyword argument 'x'``, as under Lightning (issue 41;
trainer/test_trainer.py::test_trainer_subclassing matches ``__init__\\(\\) got an unexpected ...``):
the declared signature's binding (trainer/settings/declaration.py) said only "got an unexpected ..."."""
from __future__ import annotations

import pytest

from zerotrain import Trainer

pytestmark = pytest.mark.timeout(60)


def test_an_unknown_keyword_reads_as_pythons_call_error():
    with pytest.raises(TypeError, match=r"^Trainer\.__init__\(\) got an unexpected keyword argument 'abcdefg'$"):
        Trainer(abcdefg="unknown_arg")


def test_a_subclass_that_passes_kwargs_on_gets_the_same_words():
    class TrainerSubclass(Trainer):
        def __init__(self, **kwargs):
            self.custom_arg = kwargs.pop("custom_arg", 0)
            super().__init__(**kwargs)

    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'abcdefg'"):
        TrainerSubclass(abcdefg="unknown_arg")


def test_lightnings_words_alike():
    pl = pytest.importorskip("pytorch_lightning")
    with pytest.raises(TypeError) as theirs:
        pl.Trainer(abcdefg=1)
    with pytest.raises(TypeError) as ours:
        Trainer(abcdefg=1)
    assert str(ours.value) == str(theirs.value)
