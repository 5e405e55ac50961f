"""Noticing when code reads or writes a parameter whose values are not on this rank.

:class:`ParamTouchMode` is a ``TorchFunctionMode``: while it is active, every torch function that
gets one of the watched parameters as an argument first calls
``on_touch(params, func, args, kwargs)``.
Queries that only need metadata (``shape``, ``dim()``, ``dtype``, ``requires_grad`` ...) do not
count, since a sharded parameter's placeholder answers them correctly. ZeRO-3 uses it twice:

* partitioned construction (``materialize.py``): the model's own init code runs on parameters
  that were partitioned when they were registered; a touched parameter is gathered for the op;
* the outside-forward fallback (``hooks.py``): a parameter used outside the forward of its unit
  (say, a block's weight in a loss term) is gathered on demand instead of reading placeholders.

Inside ``__torch_function__`` torch disables the mode, so the op itself (and the collectives
``on_touch`` issues) are not intercepted again. :meth:`ParamTouchMode.silenced` silences the mode
while the strategy's own hooks move parameters around.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

#: attributes and methods that only read metadata a placeholder has right
METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "is_cuda",
    "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "grad_fn", "_grad_fn",
    "name", "dim", "size", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "__len__", "get_device", "requires_grad_", "retain_grad", "register_hook", "__hash__",
    "_backward_hooks", "_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook",
})
#: functions that overwrite every element of their first argument without reading it: a
#: partitioned parameter they touch need not be gathered first
OVERWRITES = frozenset({
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_", "fill_", "zero_", "random_", "copy_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_",
})


def func_name(func: Any) -> str:
    """``shape`` for ``Tensor.shape.__get__``, ``normal_`` for ``Tensor.normal_`` ..."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def is_overwrite(func: Any, args: tuple, kwargs: dict, param: torch.Tensor) -> bool:
    """``func`` overwrites ``param`` entirely (``nn.init`` functions pass it as ``tensor=``)."""
    first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    return first is param and func_name(func) in OVERWRITES


class ParamTouchMode(TorchFunctionMode):
    def __init__(self, watched: dict[int, Any], on_touch: Callable[[list, Any, tuple, dict], None]) -> None:
        """``watched`` maps ``id(param)`` to anything; it is read live, so the caller may change
        it while the mode is active."""
        super().__init__()
        self.watched = watched
        self.on_touch = on_touch
        self.quiet = 0  # how many silenced() blocks are open

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """The strategy's own tensor work (gathering, freeing, partitioning) inside this block is
        not a 'use' of a parameter; blocks nest."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.quiet and self.watched and func_name(func) not in METADATA:
            hit = _watched_in(args, self.watched) + _watched_in(tuple(kwargs.values()), self.watched)
            if hit:
                self.on_touch(_unique(hit), func, args, kwargs)
        return func(*args, **kwargs)


def _watched_in(values: tuple, watched: dict[int, Any]) -> list:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if id(v) in watched:
                out.append(v)
        elif isinstance(v, (list, tuple)):  # torch.cat([...]), foreach ops
            out.extend(t for t in v if isinstance(t, torch.Tensor) and id(t) in watched)
    return out


def _unique(ts: list) -> list:
    seen, out = set(), []
    for t in ts:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
