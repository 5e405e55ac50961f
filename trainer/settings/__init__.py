"""The Trainer's settings: the checks of its arguments and the callbacks and loggers they imply
(``arguments.py``), Lightning's run options (``run_options.py``), ``PL_TRAINER_*`` defaults from the
environment (``env_args.py``) and the checks of ``callbacks=`` / ``logger=`` (``plugin_checks.py``).

May import: trainer.errors, trainer.utilities, callbacks."""
