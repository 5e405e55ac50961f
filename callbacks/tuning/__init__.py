"""Lightning's tuning callbacks and its ``Tuner``: ``StochasticWeightAveraging`` (``swa.py``; its
averaged weights go into ZeRO-1/2's masters through ``write_back.py``), the learning-rate range
test (``lr_finder.py``: ``LearningRateFinder``) and the batch-size search (``batch_size_finder.py``:
``BatchSizeFinder``), both run by ``Tuner`` (``tuner.py``, Lightning's ``lightning.pytorch.tuner``)
inside the fit's ``on_fit_start``; ``attrs.py`` finds the ``lr``/``batch_size`` they set.

May import: callbacks.base, trainer.checkpoint, trainer.errors, trainer.optim, trainer.utilities."""
from .batch_size_finder import BatchSizeFinder
from .lr_finder import LearningRateFinder
from .swa import StochasticWeightAveraging

__all__ = ["BatchSizeFinder", "LearningRateFinder", "StochasticWeightAveraging"]
