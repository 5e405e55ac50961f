"""``zerotrain.deepspeed.runtime``: the parts of DeepSpeed's ``deepspeed.runtime`` that scripts call
directly (``deepspeed.runtime.utils.set_random_seed``)."""
from . import utils  # noqa: F401

__all__ = ["utils"]
