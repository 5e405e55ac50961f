"""The Engine: zerotrain's strategies under a loop the user writes (``engine.py``), the model, optimizers
and loaders its ``setup`` hands back (``wrappers.py``), several models in one Engine
(``models.py``), Fabric's names for it (``fabric.py``) and a TrainModule logging through a Fabric
(``module_fabric.py``).

May import: trainer.api, trainer.checkpoint, trainer.compat, trainer.errors, trainer.launch, trainer.loop, trainer.settings, trainer.utilities, strategies."""
