"""What the user subclasses and calls: ``TrainModule`` (``module.py``, with ``module_tools.py`` and
``conveniences.py``), ``DataModule`` (``datamodule.py``, ``datamodule_info.py``), hyperparameters
(``hparams.py``, ``saving.py``) and ``load_from_checkpoint`` (``from_checkpoint.py``).

May import: trainer.checkpoint, trainer.compat, trainer.engine, trainer.errors, trainer.optim, callbacks, strategies."""
