"""``zerotrain.core``: the module classes under the path Lightning keeps them at
(``lightning.pytorch.core``): ``TrainModule`` is ``LightningModule``'s equivalent, ``DataModule``
``LightningDataModule``'s."""
from .module import TrainModule

try:  # trainer/datamodule.py comes with the DataModule work (issue 12); absent before it lands
    from .datamodule import DataModule
except ImportError:  # pragma: no cover - only on a checkout without it
    __all__ = ["TrainModule"]
else:
    __all__ = ["TrainModule", "DataModule"]
