"""What ``deepspeed.zero.Init`` does to a model's initialisation, beyond partitioning.

zerotrain's own partitioned build (``Engine.init_module``) gives the weights of an eager build.
DeepSpeed 0.19.8's ``zero.Init`` does not, and a DeepSpeed script's numbers depend on it:

* a module's parameters are partitioned when its constructor returns; from then on the
  parameter's ``.data`` is an empty tensor on every rank, so a later initialisation that writes it
  in place (transformers' ``post_init``, a parent module's loop over its children's weights) changes
  nothing. Only ``Module.apply(fn)`` (DeepSpeed gathers each module's parameters for ``fn``) and
  ``GatheredParameters(..., modifier_rank=r)`` write into the partitions. A transformers model built
  under ``zero.Init`` without transformers' own DeepSpeed integration therefore keeps the torch
  layers' constructor initialisation (``nn.Linear``'s Kaiming-uniform, ``nn.Embedding``'s normal);
* floating-point tensors created inside the block (``torch.empty``, ``zeros``, ``ones``, ``full``,
  ``arange``, ``eye``, ``randn``, ``tensor``) are cast to the config's type (fp16/bf16, else fp32),
  so the layers draw their initial values in that type: under bf16 other values than an fp32 draw
  rounded; under fp32 an fp32 draw even where transformers set bf16 as the default type.

:class:`DeepSpeedInitRules` applies both on top of the strategy's partitioned build: a parameter is
*sealed* when its module is registered in a parent (its constructor has returned by then); an
in-place write of a sealed parameter is dropped and its ``.data`` reads as an empty tensor, as in
DeepSpeed; ``Module.apply`` and ``GatheredParameters(modifier_rank=...)`` unseal for their span.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ....strategies.zero.stage3.touch import func_name, is_overwrite

#: torch factory functions DeepSpeed's Init makes return the config's 16-bit type
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
#: in-place operators that write their first operand (besides ``name_`` methods)
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__"})


def writes_first_operand(func: Any, args: tuple, kwargs: dict, param: torch.Tensor) -> bool:
    """``func`` writes ``param`` in place: an ``nn.init`` function or ``Tensor.x_`` method given it
    first, or an in-place operator on it."""
    if is_overwrite(func, args, kwargs, param):
        return True
    first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
    if first is not param:
        return False
    name = func_name(func)
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


class _SealMode(TorchFunctionMode):
    """Drops in-place writes of sealed parameters; their ``.data`` is an empty tensor."""

    def __init__(self, rules: "DeepSpeedInitRules") -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sealed = self.rules.sealed
        if sealed:
            for t in (*args, *kwargs.values()):
                if isinstance(t, nn.Parameter) and id(t) in sealed and id(t) not in self.rules.open:
                    if func_name(func) == "data" and getattr(func, "__name__", "") == "__get__":
                        return torch.empty(0, dtype=t.dtype, device=t.device)
                    if writes_first_operand(func, args, kwargs, t):
                        return t
        return func(*args, **kwargs)


class DeepSpeedInitRules:
    """Context manager, entered inside the strategy's partitioned build: DeepSpeed's ``zero.Init``
    rules above. ``dtype`` is the config's type (None: leave new tensors as they are made)."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.sealed: set[int] = set()
        self.open: set[int] = set()  # sealed ones Module.apply / GatheredParameters may write now
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "DeepSpeedInitRules":
        st = self._stack
        st.enter_context(self._factories())
        handle = nn.modules.module.register_module_module_registration_hook(self._registered)
        st.callback(handle.remove)
        orig_apply = nn.Module.apply
        nn.Module.apply = self._apply_with_writes(orig_apply)
        st.callback(setattr, nn.Module, "apply", orig_apply)
        st.enter_context(_SealMode(self))
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._stack.close()
        return False

    # ------------------------------------------------------------------ the rules
    def _registered(self, parent: nn.Module, name: str, child: Any) -> None:
        """``child`` (its constructor has returned) joins ``parent``: its parameters are sealed."""
        if isinstance(child, nn.Module):
            self.sealed.update(id(p) for p in child.parameters())

    @contextlib.contextmanager
    def writable(self, params: "list[nn.Parameter]") -> Iterator[None]:
        """Writes of ``params`` reach their partitions inside (they nest)."""
        ids = [id(p) for p in params if id(p) in self.sealed and id(p) not in self.open]
        self.open.update(ids)
        try:
            yield
        finally:
            self.open.difference_update(ids)

    def _apply_with_writes(self, orig_apply: Callable) -> Callable:
        rules = self

        @functools.wraps(orig_apply)
        def apply(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
            def each(m: nn.Module) -> None:
                with rules.writable(list(m.parameters(recurse=False))):
                    fn(m)
            return orig_apply(module, each)

        return apply

    @contextlib.contextmanager
    def _factories(self) -> Iterator[None]:
        if self.dtype is None:
            yield
            return
        originals = {name: getattr(torch, name) for name in FACTORIES}

        def cast(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def made(*args: Any, **kwargs: Any) -> torch.Tensor:
                t = fn(*args, **kwargs)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.dtype:
                    t.data = t.data.to(self.dtype)
                return t
            return made

        for name, fn in originals.items():
            setattr(torch, name, cast(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(torch, name, fn)


#: the rules of the ``zero.Init`` block now open (GatheredParameters reads it)
active: list[DeepSpeedInitRules] = []


# ------------------------------------------------------------------ ZeRO-3's linear layer
class Stage3Linear(torch.autograd.Function):
    """``F.linear`` as DeepSpeed 0.19.8 computes it once a ZeRO-3 engine exists
    (``zero_optimization.memory_efficient_linear``, default true: ``deepspeed.initialize`` at stage 3
    replaces ``torch.nn.functional.linear`` with its own autograd function). Its arithmetic, not
    torch's fused one: the bias is added to the rounded product unless the input is 2-D; the weight's
    gradient is one matrix product over the flattened leading dimensions, the bias's a sum over them;
    the backward runs under the forward's autocast state. In 16-bit types this rounds differently
    from ``F.linear``, so DeepSpeed's stage 3 trains on other gradients than its stages 1/2."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        device = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        ctx.save_for_backward(x, weight, bias)
        if bias is not None and x.dim() == 2:
            return torch.addmm(bias, x, weight.t())
        out = x.matmul(weight.t())
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        enabled, dtype, device = ctx.autocast
        d_x = d_w = d_b = None
        with torch.autocast(device, enabled=enabled, dtype=dtype):
            if ctx.needs_input_grad[0]:
                d_x = grad.matmul(weight)
            if ctx.needs_input_grad[1]:
                if grad.dim() == 1:
                    d_w = grad.unsqueeze(-1) * x.unsqueeze(0)
                else:
                    d_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
            if bias is not None and ctx.needs_input_grad[2]:
                d_b = grad if grad.dim() == 1 else grad.sum(list(range(grad.dim() - 1)))
        return d_x, d_w, d_b


def stage3_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return Stage3Linear.apply(x, weight, bias)


#: torch's own ``F.linear``, kept while :func:`use_stage3_linear` has one installed in its place
_TORCH_LINEAR: list = []
#: the attribute that marks a stage-3 engine's parameters
STAGE3_LINEAR = "_zerotrain_stage3_linear"


@torch.jit.unused
def _eager_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if getattr(weight, STAGE3_LINEAR, False) or getattr(weight._base, STAGE3_LINEAR, False):  # or a slice of one
        return Stage3Linear.apply(x, weight, bias)
    return _TORCH_LINEAR[0](x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` while a ZeRO-3 engine exists: :func:`stage3_linear` for its layers' weights,
    torch's for every other model of the process (and in TorchScript, which compiles this
    function when it scripts any ``nn.Linear`` of the process: torch's op)."""
    if torch.jit.is_scripting():
        return torch._C._nn.linear(x, weight, bias)
    return _eager_linear(x, weight, bias)


def use_stage3_linear(params: Any) -> None:
    """DeepSpeed's stage-3 linear for these parameters' layers, wherever ``F.linear`` runs on them:
    the engine's forward, an activation checkpoint's recomputation inside backward (its saved
    tensors must match the forward's), a plain ``loss.backward()``. Other models of the process
    keep torch's ``F.linear``: DeepSpeed swaps it for the whole process, which would change every
    other model's 16-bit results."""
    if not _TORCH_LINEAR:
        _TORCH_LINEAR.append(torch.nn.functional.linear)
        torch.nn.functional.linear = _linear
    for p in params:
        setattr(p, STAGE3_LINEAR, True)


# ------------------------------------------------------------------ ZeRO-3's module boundaries
class ModuleBoundary(torch.autograd.Function):
    """The identity DeepSpeed 0.19.8's stage 3 applies to every tensor each module of the model
    takes (its positional arguments) and returns (``parameter_offload.py``'s pre- and post-backward
    functions, there to gather and release parameters in backward). Each argument becomes a tensor
    of its own, so a module given one tensor several times sees distinct ones
    (``nn.MultiheadAttention(x, x, x)`` then projects query, key and value separately), and a
    tensor's gradient is summed over these nodes in the order autograd meets them: in 16-bit types
    other sums than without them. :func:`use_module_boundaries` adds them as DeepSpeed does."""

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _each_tensor(value: Any) -> Any:
    """``ModuleBoundary`` on every tensor of ``value`` (tuples, lists, named tuples, dicts in place)."""
    if isinstance(value, (tuple, list)):
        out = [_each_tensor(v) for v in value]
        return type(value)(*out) if hasattr(value, "_fields") else type(value)(out)
    if isinstance(value, dict):
        for key in value:
            value[key] = _each_tensor(value[key])
        return value
    if isinstance(value, torch.Tensor):
        return ModuleBoundary.apply(value)
    return value


def use_module_boundaries(module: torch.nn.Module) -> list:
    """DeepSpeed's stage-3 boundaries on ``module`` and every submodule: a forward pre-hook on the
    positional arguments, a forward hook on the outputs. Returns the hooks' handles."""
    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(lambda _m, args: _each_tensor(args)))
        handles.append(m.register_forward_hook(lambda _m, _args, out: _each_tensor(out)))
    return handles
