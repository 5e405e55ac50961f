"""The Trainer's optimizers and LR schedulers: ``configure_optimizers()``'s output read as Lightning
reads it (``optimizer_config.py``), stepping, manual optimization and clipping through the strategy
(``optimization.py``), ``toggle_optimizer`` (``toggling.py``).

May import: trainer.errors, trainer.logs, strategies."""
