"""Names Lightning's users and tests import from paths zerotrain has no module of its own for
(``zerotrain.accelerators``, ``.profilers``, ``.loops``, ``.fabric.utilities.data``, ...): small
modules registered under Lightning's paths by ``trainer/compat/lightning_paths.py`` and
``trainer/compat/fabric_paths.py``. Each name either behaves as Lightning's (data-loader checks,
``is_picklable``, parameter sanitizing, a simple profiler) or, where it names one of Lightning's
internals zerotrain does not have (loop and connector objects, launchers, XLA), is a class whose
use raises ``NotImplementedError`` saying so; importing never fails.

May import: trainer.api, trainer.engine, trainer.loop, callbacks."""
