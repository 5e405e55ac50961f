"""``zerotrain.core``: the module classes under the path Lightning keeps them at
(``lightning.pytorch.core``): ``TrainModule`` is ``LightningModule``'s equivalent, ``DataModule``
``LightningDataModule``'s."""
from ..api.module import TrainModule

from ..api.datamodule import DataModule

__all__ = ["TrainModule", "DataModule"]
