"""``self.log``: what one call means and how the values of a name combine (``results.py``), and the
Trainer's side of it: the active collection, the metric dicts and the rows sent to the loggers
(``connector.py``).

May import: trainer.errors, trainer.utilities."""
