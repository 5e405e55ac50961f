"""``torch.compile`` under every strategy, one region per block (as torchtitan compiles each
transformer block).

A strategy's ``compile`` (a :class:`CompileConfig`, set by ``Trainer(compile=...)``, by a compiled
module given to ``Engine.setup`` / ``Fabric.setup`` / ``Trainer.fit``, or by the DeepSpeed
engine's ``compile()``) is applied by ``Strategy.compile_module()`` once the strategy has set the
module up. Each region is one module whose ``forward`` is replaced by its compiled form; the
module's ``__call__`` (with every forward hook on it) stays eager. So ZeRO-3's gather and release
hooks, DDP's reducer hooks and the pipeline's stage boundaries run between the compiled graphs,
never inside one, and blocks of one class share one compiled graph (their parameters are graph
inputs). The regions are, in order of preference:

* the strategy's own blocks (``Strategy.compile_blocks()``: ZeRO-3's unit modules);
* the repeated blocks (``repeated_blocks``: children of one module whose class, the model's own,
  occurs two or more times there: a ``ModuleList`` of transformer blocks, a pipeline stage's blocks);
* else the whole model (its ``forward``; without one, each child holding parameters).

``regional=False`` compiles the whole model's ``forward`` under every strategy (under ZeRO-3 its
gather hooks then break the graph at every unit: each break is a graph of its own).

Compiled graphs are counted (``CompileStats``): each graph that the backend compiles adds one, so
a count that grows after the first steps is a recompilation.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from .options import check_bool, check_choice

#: ``torch.compile``'s modes
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass
class CompileStats:
    """What the backend compiled: ``graphs`` (one per captured graph; recompilations included)
    and the seconds spent in the backend's compile calls."""

    graphs: int = 0
    seconds: float = 0.0


class _CountingBackend:
    """A backend that counts and times the graphs it hands to ``inner`` (a backend name or callable)."""

    def __init__(self, inner: Any, stats: CompileStats) -> None:
        self.inner, self.stats = inner, stats
        self._lock = threading.Lock()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend
        start = time.perf_counter()
        try:
            return lookup_backend(self.inner)(gm, example_inputs, **kwargs)
        finally:
            with self._lock:
                self.stats.graphs += 1
                self.stats.seconds += time.perf_counter() - start


@dataclasses.dataclass
class CompileConfig:
    """How a strategy compiles the model: ``torch.compile``'s ``backend``, ``mode``, ``fullgraph``,
    ``dynamic`` and ``options``; ``regional`` (default True): one compiled region per block (see
    the module docstring), else the whole model. ``context``: a compiled module's own dynamo
    context (``torch.compile(model).dynamo_ctx``), used instead of the fields above when the user
    compiled the model themselves."""

    backend: Any = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict | None = None
    regional: bool = True
    context: Any = None
    stats: CompileStats = dataclasses.field(default_factory=CompileStats, repr=False, compare=False)
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner = "compile"
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise TypeError(f"{owner}: backend={self.backend!r}; valid: a backend name "
                            f"(torch._dynamo.list_backends(): inductor, aot_eager, eager, ...) or a callable")
        if isinstance(self.backend, str):
            check_choice(owner, "backend", self.backend, _backends())
        if self.mode not in MODES:
            raise ValueError(f"{owner}: mode={self.mode!r}; valid choices: None, {', '.join(MODES[1:])}")
        check_bool(owner, "fullgraph", self.fullgraph)
        check_bool(owner, "regional", self.regional)
        if self.dynamic is not None:
            check_bool(owner, "dynamic", self.dynamic)
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"{owner}: options={self.options!r}; valid: None or a dict of the backend's options")
        if self.mode is not None and self.options:
            raise ValueError(f"{owner}: mode={self.mode!r} and options={self.options!r}; valid: one of them "
                             "(torch.compile takes either)")

    @classmethod
    def parse(cls, value: Any, owner: str = "Trainer") -> "CompileConfig | None":
        """``compile=`` as a user gives it: None/False (off), True (the defaults), a dict of the
        fields, or a CompileConfig. Errors name the field, the value and what is valid."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict) or hasattr(value, "items"):
            fields = {f.name for f in dataclasses.fields(cls)} - {"stats", "context", "_compiled"}
            unknown = sorted(set(value) - fields)
            if unknown:
                raise ValueError(f"{owner}: compile has unknown key(s) {unknown}; valid keys: {', '.join(sorted(fields))}")
            try:
                return cls(**dict(value))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{owner}: {exc}") from None
        raise TypeError(f"{owner}: compile={value!r}; valid: True, False, None or a dict of "
                        "backend/mode/fullgraph/dynamic/options/regional")

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` compiled as configured (counted in ``stats`` unless the user's own context). A
        bound method is compiled once per function, and bound again: blocks of one class share one
        compiled function, so that they share its graphs (dynamo keeps graphs per backend)."""
        owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
        if owner is not None and func is not None:
            compiled = self._compiled.get(func)
            if compiled is None:
                compiled = self._compiled[func] = self.wrap(func)
            return functools.partial(compiled, owner)
        if self.context is not None:
            return self.context(fn)
        return torch.compile(fn, backend=_CountingBackend(self.backend, self.stats), fullgraph=self.fullgraph,
                             dynamic=self.dynamic, mode=self.mode, options=self.options)


def _backends() -> tuple[str, ...]:
    import torch._dynamo
    return tuple(torch._dynamo.list_backends(exclude_tags=())) or ("inductor",)


def unwrap_compiled(model: Any) -> tuple[Any, "CompileConfig | None"]:
    """``torch.compile(model)`` (an ``OptimizedModule``) -> ``(model, a CompileConfig with the
    user's dynamo context)``; anything else -> ``(model, None)``."""
    from torch._dynamo.eval_frame import OptimizedModule
    if not isinstance(model, OptimizedModule):
        return model, None
    return model._orig_mod, CompileConfig(context=model.dynamo_ctx)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: under each module, its direct children holding parameters whose class
    (one of the model's own, not ``torch.nn``'s: two ``nn.Linear`` of an MLP are no blocks) occurs two
    or more times there (a ``ModuleList`` of blocks, a pipeline stage's layers beside its embedding
    and head). Outermost first; a block's insides are not searched."""
    found: list[nn.Module] = []

    def own_class(c: nn.Module) -> bool:
        return not type(c).__module__.startswith("torch.")

    def visit(m: nn.Module) -> None:
        kids = list(m.children())
        counts = collections.Counter(type(c) for c in kids if own_class(c) and any(True for _ in c.parameters()))
        found.extend(c for c in kids if counts.get(type(c), 0) >= 2)
        for c in kids:
            if counts.get(type(c), 0) < 2:
                visit(c)

    visit(module)
    return found


class CompiledRegions:
    """The modules whose ``forward`` was replaced by a compiled one; ``restore()`` puts the eager
    forwards back."""

    def __init__(self, modules: Sequence[nn.Module], config: CompileConfig, names: Sequence[str],
                 around: Callable[[], ContextManager] | None = None) -> None:
        self.config, self.names, self.modules = config, list(names), list(modules)
        self._saved: list[tuple[nn.Module, Any]] = []
        for m in modules:
            self._saved.append((m, m.__dict__.get("forward")))
            compiled = config.wrap(m.forward)
            m.forward = compiled if around is None else _Around(compiled, around)

    def restore(self) -> None:
        for m, own in reversed(self._saved):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self._saved.clear()


class _Around:
    """A compiled forward called inside ``around()`` (the strategy's context for compiled code)."""

    def __init__(self, fn: Callable, around: Callable[[], ContextManager]) -> None:
        self.fn, self.around = fn, around

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.around():
            return self.fn(*args, **kwargs)


def whole_model(module: nn.Module) -> list[nn.Module]:
    """The module itself when it has a ``forward`` of its own, else its children that hold
    parameters (a TrainModule whose ``training_step`` calls ``self.net`` has no forward)."""
    if type(module).forward is not nn.Module.forward:
        return [module]
    return [c for c in module.children() if any(True for _ in c.parameters())]


def compile_regions(module: nn.Module, config: CompileConfig, blocks: Sequence[nn.Module] | None = None,
                    around: Callable[[], ContextManager] | None = None) -> CompiledRegions:
    """Compile ``module``'s blocks (``blocks``, else ``repeated_blocks``), or the whole module when
    it has none or ``config.regional`` is False; each compiled call runs inside ``around()``."""
    if config.regional:
        chosen = list(blocks) if blocks else repeated_blocks(module)
    else:
        chosen = []
    chosen = chosen or whole_model(module)
    name_of = {id(m): n for n, m in module.named_modules()}
    return CompiledRegions(chosen, config, [name_of.get(id(m), "?") or "<model>" for m in chosen], around)
