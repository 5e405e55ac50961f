"""``deepspeed.runtime.sequence_parallel``: ALST's Ulysses for Hugging Face models (``ulysses_sp``:
the attention registration and the data-loader adapter) and its sequence-parallel groups
(``parallel_state_sp``), on ``zerotrain.strategies.parallel``."""
from . import parallel_state_sp, ulysses_sp  # noqa: F401

__all__ = ["parallel_state_sp", "ulysses_sp"]
