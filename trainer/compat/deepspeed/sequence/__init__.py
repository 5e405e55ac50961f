"""``deepspeed.sequence``: Ulysses sequence parallelism's attention wrapper (``layer``), on
``zerotrain.strategies.parallel``."""
from . import layer  # noqa: F401
