"""``deepspeed.runtime.lr_schedules``, DeepSpeed's own path for its schedules and their names:
the classes and names of ``zerotrain.deepspeed.lr_schedules`` (the same objects)."""
from ..lr_schedules import *  # noqa: F401,F403
from ..lr_schedules import __all__  # noqa: F401
