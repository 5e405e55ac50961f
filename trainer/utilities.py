"""``zerotrain.utilities``: Lightning's rank-zero helpers and ``seed_everything`` under their
Lightning names (``lightning.pytorch.utilities``), for code ported by renaming the import."""
from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any, Callable, TypeVar

from .trainer import seed_everything  # Lightning's signature; one implementation

log = logging.getLogger("zerotrain")
F = TypeVar("F", bound=Callable[..., Any])


def global_rank() -> int:
    """This process's global rank, read when asked (not at import: the launcher sets ``RANK`` for
    rank 0 only when ``fit`` starts): the process group's, else ``RANK``, ``SLURM_PROCID``, 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _RankZeroOnly:
    """``@rank_zero_only`` runs the function on global rank 0 and returns None elsewhere;
    ``rank_zero_only.rank`` is the current global rank, as in Lightning."""

    @property
    def rank(self) -> int:
        return global_rank()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if global_rank() == 0 else None

        return wrapped  # type: ignore[return-value]


rank_zero_only = _RankZeroOnly()


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    log.info(*args, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, **kwargs: Any) -> None:
    log.debug(*args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 4) -> None:
    warnings.warn(message, category, stacklevel=stacklevel)


__all__ = ["rank_zero_only", "rank_zero_info", "rank_zero_debug", "rank_zero_warn", "seed_everything",
           "global_rank"]
