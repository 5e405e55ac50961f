"""The Trainer and its loops: ``fit`` / ``validate`` / ``test`` / ``predict`` (``trainer.py``,
``evaluation.py``), one training step's halves (``step.py``: forwards and backwards, the optimizer
step), the one place hooks are called and the loop's phases marked (``hooks.py``), the loop's counters
and state (``state.py``, ``progress.py``), when the loop stops (``limits.py``), Lightning's Trainer attributes
(``properties.py``) and the set-up around a run (``setup.py``).

May import: trainer.api, trainer.checkpoint, trainer.compat.lightning, trainer.data, trainer.errors, trainer.launch, trainer.logs, trainer.optim, trainer.settings, trainer.utilities, callbacks, strategies."""
