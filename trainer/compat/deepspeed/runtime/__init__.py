"""``zerotrain.deepspeed.runtime``: the parts of DeepSpeed's ``deepspeed.runtime`` that scripts call
directly (``deepspeed.runtime.utils.set_random_seed``, ``deepspeed.runtime.lr_schedules``)."""
from . import lr_schedules, utils  # noqa: F401

__all__ = ["lr_schedules", "utils"]
