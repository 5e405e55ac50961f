"""``deepspeed.ops``: the optimizers DeepSpeed scripts import by name (``adam``)."""
from . import adam  # noqa: F401
