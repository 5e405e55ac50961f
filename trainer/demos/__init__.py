"""``zerotrain.demos``: Lightning's demo models and data under Lightning's names
(``lightning.pytorch.demos``): the boring classes (``boring_classes.py``), the small Transformer and
WikiText2 (``transformer.py``) and MNIST (``mnist_datamodule.py``). For tests and debugging only.

May import: trainer.api, trainer.compat."""
from .boring_classes import *  # noqa: F401,F403
from .boring_classes import __all__  # noqa: F401
