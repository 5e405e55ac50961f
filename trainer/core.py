"""``zerotrain.core``: the module classes under the path Lightning keeps them at
(``lightning.pytorch.core``): ``TrainModule`` is ``LightningModule``'s equivalent, ``DataModule``
``LightningDataModule``'s."""
from .module import TrainModule

from .datamodule import DataModule

__all__ = ["TrainModule", "DataModule"]
