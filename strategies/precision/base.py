"""Precision plugins: how the forward runs, how the backward runs, how overflow is handled.

The base class is the "32" plugin and every method is a no-op (or the plain operation), so a
strategy calls the same methods whatever the precision (a null object instead of ``if fp16:``
branches). As in Lightning Fabric, the plugin owns the backward: ``backward_loss`` is
``pre_backward`` (scale the loss) -> ``backward`` (run autograd) -> ``post_backward``, written once
here; ``Strategy.backward`` and the pipeline's last stage call it, the other stages call
``backward`` with the gradients they received. Nothing else in the library calls autograd's
backward (``tests/unit/test_structure.py``). A backward the user starts themselves goes through
``Strategy.user_backward``, which hands out ``loss_scale``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Sequence

import torch


class Precision:
    """Full fp32 precision; the no-op defaults every other plugin overrides selectively."""

    name = "32"
    #: dtype of the working (forward/backward) parameters. Replicated strategies keep fp32 params
    #: under autocast; sharded strategies and "-true" precisions store working params in this dtype.
    param_dtype: torch.dtype = torch.float32
    #: dtype autocast computes in, or None for no autocast.
    autocast_dtype: torch.dtype | None = None
    #: True where the plugin itself skips steps whose gradients are not finite (the fp16 loss
    #: scaler); elsewhere the Trainer's ``on_nonfinite`` decides.
    skips_nonfinite_steps: bool = False

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast a freshly built module for this precision (only "-true" precisions cast); called
        only by ``Strategy.setup_module``."""
        return module

    def convert_input(self, batch: Any) -> Any:
        """The batch as the step should see it: unchanged here; "-true" precisions cast its
        floating-point tensors to their dtype (as Lightning's ``convert_input``)."""
        return batch

    def forward_context(self, device_type: str = "cpu") -> contextlib.AbstractContextManager:
        """What every forward runs under (autocast to ``autocast_dtype``, or nothing); entered
        only by ``Strategy.run_forward``."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (the identity unless the plugin scales)."""
        return loss

    # ------------------------------------------------------------------ the backward
    def backward_loss(self, loss: torch.Tensor, model: torch.nn.Module | None, run: Callable | None = None,
                      **backward_kwargs: Any) -> torch.Tensor:
        """The backward of one loss: ``pre_backward`` (the loss scale) -> ``backward`` (autograd;
        ``run`` and ``backward_kwargs`` as there) -> ``post_backward``; returns what autograd ran from."""
        loss = self.pre_backward(loss)
        self.backward(loss, model, run=run, **backward_kwargs)
        self.post_backward(loss)
        return loss

    def pre_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """What autograd runs from: the loss, scaled if this plugin scales it."""
        return self.scale_loss(loss)

    def backward(self, tensor: torch.Tensor | Sequence[torch.Tensor], model: torch.nn.Module | None,
                 grad_tensors: Sequence[torch.Tensor] | None = None, run: Callable | None = None,
                 **backward_kwargs: Any) -> None:
        """Run autograd from ``tensor``: a (pre-backward) loss, or a pipeline stage's outputs with
        the gradients the next stage sent for them (``grad_tensors``, already scaled). ``model``
        is the module the gradients flow into, for plugins that need it. A single loss goes
        through ``Tensor.backward``, as Lightning's plugins call it (code that wraps or counts it
        sees every backward); ``run(loss, **backward_kwargs)``, when given, calls it instead (the
        module's ``backward`` hook, as Lightning's plugins call ``model.backward``)."""
        if torch.is_tensor(tensor) and grad_tensors is None:
            (run or torch.Tensor.backward)(tensor, **backward_kwargs)
        else:
            torch.autograd.backward(tensor, grad_tensors, **backward_kwargs)

    def post_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """After autograd has run (gradients are still scaled: ``unscale_and_check`` unscales them
        at the step, once per accumulated step)."""
        return loss

    @property
    def loss_scale(self) -> float:
        return 1.0

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor], any_rank: Callable[[bool], bool]
    ) -> bool:
        """Divide ``grads`` in place by the loss scale and return True if any rank overflowed.

        ``any_rank`` is the strategy's collective OR over ranks; only plugins that can overflow
        call it, so fp32/bf16 runs pay no extra collective.
        """
        return False

    def update(self, overflow: bool) -> None:
        """Adjust the loss scale after a step (skipped or not)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def cast_floating(batch: Any, dtype: torch.dtype) -> Any:
    """``batch`` with every floating-point tensor in it (through lists, tuples and dicts) cast
    to ``dtype``; integer tensors (token ids, labels) and everything else as they are."""
    if torch.is_tensor(batch):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(cast_floating(b, dtype) for b in batch)
    if isinstance(batch, tuple):  # a namedtuple
        return type(batch)(*(cast_floating(b, dtype) for b in batch))
    if isinstance(batch, Mapping):  # dict, OrderedDict, defaultdict, UserDict (HF's BatchEncoding)
        out = copy.copy(batch)
        for k, v in batch.items():
            out[k] = cast_floating(v, dtype)
        return out
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: cast_floating(getattr(batch, f.name), dtype)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch
