"""``deepspeed.moe``: the mixture-of-experts layer (``layer.MoE``, on ``strategies/moe/``) and the
helpers scripts call on their optimizer's parameter groups (``utils``)."""
from . import layer, utils  # noqa: F401
