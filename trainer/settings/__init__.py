"""The Trainer's settings: their one declaration (``declaration.py``: the type, default, doc and
check of every ``Trainer.__init__`` argument, from which the Engine's and the CLI's are built), the
checks of its arguments and the callbacks and loggers they imply (``arguments.py``), Lightning's run
options (``run_options.py``), ``PL_TRAINER_*`` defaults from the environment (``env_args.py``) and
the checks of ``callbacks=`` / ``logger=`` (``plugin_checks.py``).

May import: trainer.compat.lightning, trainer.errors, trainer.utilities, callbacks, strategies."""
