"""``deepspeed.moe``: only the helpers scripts import whether or not they use experts (``utils``)."""
from . import utils  # noqa: F401
