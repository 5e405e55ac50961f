"""Lightning's names zerotrain has no module of its own for (registered under Lightning's paths by
``compat/lightning_paths.py``): small honest shims. Lightning's loop, connector and launcher
objects are importable names only.

May import: trainer.compat, trainer.data, trainer.errors, trainer.loop, trainer.optim, trainer.utilities."""
