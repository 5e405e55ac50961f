"""Every hook ZeRO installs, for all stages, registered here and nowhere else; each class keeps
its handles so that ``remove()`` undoes all of it. The hooks decide nothing: each calls one method
of the object that owns the step's state.

ZeRO-1/2:

* :class:`GradientHooks`: a post-accumulate-grad hook on every trainable parameter ->
  ``BucketedReduction._grad_ready`` (``comm/reduction.py``), which fills and launches buckets.
* :class:`ParamGatherHooks` (``overlap_param_gather``): a forward pre-hook on every module owning a
  trainable parameter waits, in the in-flight layer, for the post-step gathers writing that
  module's own parameters; a state-dict pre-hook on the model waits for all of them.

ZeRO-3 (:class:`Stage3Hooks`, each calling one method of
:class:`~.stage3.runtime.Stage3Runtime`):

* scope modules (the Trainer's ``StepWrapper`` and every module holding a root-unit parameter,
  e.g. the GPT itself, so ``model.generate()`` works too): forward pre-hook -> ``enter_scope``,
  forward hook -> ``exit_scope``. While the outermost scope runs, a :class:`~.touch.ParamTouchMode`
  watches the sharded parameters and gathers a unit whose parameter is used outside its forward.
* unit modules: forward pre-hook -> ``pre_forward``, and (grad enabled) the inputs are routed
  through :class:`PostBackward`, whose backward runs once gradients have flowed through the
  whole unit -> ``post_backward``; forward hook -> ``post_forward``, and a multi-grad hook on the
  outputs fires when the first gradient reaches them -> ``pre_backward``.
* activation checkpointing: a unit's ``forward`` is replaced by :class:`CheckpointedForward`,
  which runs it under non-reentrant ``torch.utils.checkpoint``; the recomputation in backward
  first makes sure the unit is gathered.

Forward hooks use ``always_call=True``, so a forward that raises still leaves the scope.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .comm.inflight import InFlightQueue, Work
from .stage3.runtime import Stage3Runtime
from .stage3.touch import ParamTouchMode
from .stage3.unit import Unit


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs that require grad; its backward runs after the backward of
    everything the unit computed from them (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, callback: Callable[[], None], *inputs: torch.Tensor):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None,) + grads


class CheckpointedForward:
    """A unit's forward under non-reentrant activation checkpointing; ``before()`` runs first on
    every call, including the recomputation in backward (it gathers the unit)."""

    def __init__(self, forward: Callable[..., Any], before: Callable[[], None]) -> None:
        self.forward, self.before = forward, before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        return self.forward(*args, **kwargs)


class Stage3Hooks:
    def __init__(self, runtime: Stage3Runtime, unit_modules: Sequence[tuple[Unit, nn.Module]],
                 scope_modules: Sequence[nn.Module], activation_checkpointing: bool = False) -> None:
        self.runtime = runtime
        self.mode = ParamTouchMode(runtime.owner, self._touched)
        self._mode_active = False
        self.handles: list[Any] = []
        self._patched: list[tuple[nn.Module, Any]] = []
        self._scope_handles: dict[int, list[Any]] = {}  # id(module) -> its two scope hooks
        for m in scope_modules:
            pair = [m.register_forward_pre_hook(self._enter_scope),
                    m.register_forward_hook(self._exit_scope, always_call=True)]
            self.handles.extend(pair)
            self._scope_handles[id(m)] = pair
        for u, m in unit_modules:
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._pre_forward, u),
                                                            with_kwargs=True))
            self.handles.append(m.register_forward_hook(functools.partial(self._post_forward, u),
                                                        with_kwargs=True, always_call=True))
            if activation_checkpointing:
                self._patched.append((m, m.__dict__.get("forward")))
                m.forward = CheckpointedForward(m.forward, functools.partial(self._recompute, u))

    # ------------------------------------------------------------------ scope
    def _enter_scope(self, module: nn.Module, args: Any) -> None:
        with self.mode.silenced():
            outermost = self.runtime.enter_scope()
        if outermost:
            self.mode.__enter__()
            self._mode_active = True

    def _exit_scope(self, module: nn.Module, args: Any, output: Any) -> None:
        with self.mode.silenced():
            outermost = self.runtime.exit_scope()
        if outermost and self._mode_active:
            self._mode_active = False
            self.mode.__exit__(None, None, None)

    def drop_inner_scopes(self, blocks: Sequence[nn.Module]) -> None:
        """Remove the scope hooks of the modules inside each of ``blocks`` (a compiled region):
        the block's own scope hook (an ancestor's: every ancestor of a scope module is one) has
        entered the scope already, so theirs only count depth; inside a compiled forward dynamo
        would trace them and guard on each module's hook ids, one graph per block."""
        for block in blocks:
            for m in block.modules():
                if m is not block:
                    for h in self._scope_handles.pop(id(m), []):
                        h.remove()

    @contextlib.contextmanager
    def outside_watch(self) -> Iterator[None]:
        """A compiled region's call: the touch watch is off the torch-function stack meanwhile."""
        n = torch._C._len_torch_function_stack()
        if not (self._mode_active and n and torch._C._get_function_stack_at(n - 1) is self.mode):
            yield
            return
        self.mode.__exit__(None, None, None)
        try:
            yield
        finally:
            self.mode.__enter__()

    def _touched(self, params: list, func: Any, args: tuple, kwargs: dict) -> None:
        with self.mode.silenced():
            self.runtime.touched(params)

    # ------------------------------------------------------------------ units
    def _pre_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict):
        with self.mode.silenced():
            recomputing = self.runtime.recomputing(u)
            self.runtime.pre_forward(u)
            if not torch.is_grad_enabled() or recomputing:
                return None
            flat, spec = tree_flatten((args, kwargs))
            at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not at:
                return None
            routed = PostBackward.apply(functools.partial(self._post_backward, u), *[flat[i] for i in at])
            for i, t in zip(at, routed):
                flat[i] = t
            u.pending_backward += 1
            return tree_unflatten(flat, spec)

    def _post_forward(self, u: Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        with self.mode.silenced():
            self.runtime.post_forward(u)
            if output is None or not torch.is_grad_enabled():
                return None
            outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, functools.partial(self._pre_backward, u), mode="any")
        return None

    def _pre_backward(self, u: Unit, grad: Any) -> None:
        with self.mode.silenced():
            self.runtime.pre_backward(u)

    def _post_backward(self, u: Unit) -> None:
        with self.mode.silenced():
            self.runtime.post_backward(u)

    def _recompute(self, u: Unit) -> None:
        with self.mode.silenced():
            self.runtime.ensure_gathered(u)

    # ------------------------------------------------------------------ removal
    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for m, previous in self._patched:
            if previous is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = previous
        self._patched.clear()
        if self._mode_active:
            self._mode_active = False
            self.mode.__exit__(None, None, None)


# ---------------------------------------------------------------------- ZeRO-1/2
class _Handles:
    """The registrations' handles, kept so that ``remove()`` undoes all of them."""

    handles: list[Any]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


class GradientHooks(_Handles):
    """A post-accumulate-grad hook on each parameter of ``slots`` (``(bucket, index, param)``),
    calling ``on_grad(bucket, index, param)`` once autograd has accumulated its gradient."""

    def __init__(self, slots: Sequence[tuple[int, int, nn.Parameter]],
                 on_grad: Callable[[int, int, nn.Parameter], None]) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(on_grad, bi, i))
                        for bi, i, p in slots]


class ParamGatherHooks(_Handles):
    """``overlap_param_gather``: the post-step all-gathers are still in flight (``Work.PARAMS`` in
    ``queue``) when the step returns. A forward pre-hook on every submodule of ``module`` owning
    one of ``params`` waits through the last gather writing that module's own parameters, so
    training and no-grad (validation) forwards read fresh weights while later chunks are still
    moving; a state-dict pre-hook on ``module`` waits for all (a plain ``module.state_dict()``).
    With nothing in flight both return at once, so they stay installed after teardown.

    A module whose ``forward`` reads *another* module's parameters directly (not by calling it)
    is not covered; such models should keep the option off."""

    def __init__(self, queue: InFlightQueue, module: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.queue = queue
        ids = {id(p) for p in params}
        self.handles = [m.register_forward_pre_hook(self._pre_forward) for m in module.modules()
                        if any(id(p) in ids for p in m.parameters(recurse=False))]
        if hasattr(module, "register_state_dict_pre_hook"):
            self.handles.append(module.register_state_dict_pre_hook(self._pre_state_dict))

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.queue.wait_writes(Work.PARAMS, (id(p) for p in module.parameters(recurse=False)))

    def _pre_state_dict(self, *args: Any) -> None:
        self.queue.wait(Work.PARAMS)
