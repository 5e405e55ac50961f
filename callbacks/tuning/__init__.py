"""Lightning's tuning callbacks and its ``Tuner``: ``StochasticWeightAveraging`` (``swa.py``; its
averaged weights go into ZeRO-1/2's masters through ``write_back.py``), the learning-rate range
test (``lr_finder.py``: ``LearningRateFinder``, ``lr_find``) and the batch-size search
(``batch_size_finder.py``: ``BatchSizeFinder``, ``scale_batch_size``), both driven by
``Tuner`` (``tuner.py``, Lightning's ``lightning.pytorch.tuner``)."""
from .swa import StochasticWeightAveraging

__all__ = ["StochasticWeightAveraging"]
