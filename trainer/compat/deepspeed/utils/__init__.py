"""``deepspeed.utils``: the small helpers DeepSpeed scripts import from it: ``logger``,
``log_dist`` / ``print_dist`` (a message on chosen ranks), ``RepeatingLoader``, and the
tensor-fragment accessors ``safe_get_full_fp32_param`` and its siblings (``tensor_fragment.py``).

``logger`` is zerotrain's ``zerotrain.deepspeed`` logger (a child of ``zerotrain``, so it follows
zerotrain's logging set-up: INFO on rank 0, warnings elsewhere), not DeepSpeed's own "DeepSpeed"
logger with its stdout handler.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from .tensor_fragment import *  # noqa: F401,F403  (deepspeed.utils.safe_get_full_grad, ...)
from .tensor_fragment import __all__ as _fragment_names

logger = logging.getLogger("zerotrain.deepspeed")


def _on_these_ranks(message: str, ranks: Sequence[int] | None) -> str | None:
    """DeepSpeed's rule: without a process group every call shows; with one, only the ranks in
    ``ranks`` (``[-1]``: all of them; None or empty: none). The text gets DeepSpeed's
    ``[Rank r]`` prefix (r = -1 without a group)."""
    if not dist.is_initialized():
        return f"[Rank -1] {message}"
    rank = dist.get_rank()
    ranks = list(ranks or [])
    if ranks and (ranks[0] == -1 or rank in ranks):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message: str, ranks: Sequence[int] | None = None, level: int = logging.INFO) -> None:
    text = _on_these_ranks(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: Sequence[int] | None = None) -> None:
    """``log_dist``'s choice of ranks, printed whatever the log level."""
    text = _on_these_ranks(message, ranks)
    if text is not None:
        print(text)


class RepeatingLoader:
    """An endless iterator over ``loader``: a new pass starts when one ends (``iter(loader)``
    again, so a DistributedSampler's order repeats unless its epoch is set)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


__all__ = ["logger", "log_dist", "print_dist", "RepeatingLoader", *_fragment_names]
