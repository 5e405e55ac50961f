"""PipelineModule: a sequence of layers cut into stages, of which each process builds only its own.

Layers are modules, plain callables (no parameters), ``LayerSpec(cls, *args, **kwargs)`` (built
only on the stage that owns it) or ``TiedLayerSpec(key, cls, ...)`` (one module used at several
positions: an embedding reused as the LM head). The cut is decided at construction from the specs
alone (pure code in ``partition.py``); ``build(stage)`` then constructs the stage's layers. The
pipeline strategy calls ``build`` in ``configure_model``.

**Names.** Layer ``i`` is registered under the name ``str(i)``, exactly as ``nn.Sequential`` names
it, so a stage's ``state_dict`` is the subset of the non-pipelined ``nn.Sequential(*layers)``'s
state dict that the stage owns, key for key (``3.weight`` here is ``3.weight`` there; under a
TrainModule attribute ``pipe`` both are ``pipe.3.weight``). ``stage_state_dict`` cuts a full state
dict down to a stage; ``owner_stages_of_key`` maps a key to the stages that hold it. A tied module
appears under every index that uses it, like a shared module in a Sequential.

**Plain names.** A pipeline cut from a model that is not a plain ``nn.Sequential`` (the demo GPT:
``wte``, ``blocks.0`` ...) gives ``layer_names``, each layer's path in that model; ``plain_key``
maps ``3.attn.c_attn.weight`` to ``blocks.1.attn.c_attn.weight`` and ``canonical_key`` a tied
parameter's key to its first member's plain key (the name the plain model's ``named_parameters``
yields). Checkpoints are written under those names, so they are the layout every other strategy
writes for the plain model, whatever the number of stages.

**Ties.** A ``Tie`` names parameters, as ``(layer index, parameter name)``, that are one weight.
Stages holding a member keep a copy each; the strategy broadcasts it from the lowest owning stage
at set-up and all-reduces its gradient among the owners after the backward. Ties come from
``TiedLayerSpec`` (same key) and, in ``from_sequential``, from parameters shared between layers.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .partition import partition, stage_of_layer


class LayerSpec:
    """Build ``cls(*args, **kwargs)`` later, on the stage that owns the layer only."""

    def __init__(self, cls: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        if not callable(cls):
            raise TypeError(f"LayerSpec: {cls!r} is not a class or factory")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self) -> nn.Module:
        return self.cls(*self.args, **self.kwargs)

    # DeepSpeed's names for the same fields (``deepspeed.pipe.LayerSpec``)
    typename = property(lambda self: self.cls)
    module_args = property(lambda self: self.args)
    module_kwargs = property(lambda self: self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.cls, "__name__", repr(self.cls))
        return f"{type(self).__name__}({name}, args={self.args}, kwargs={self.kwargs})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every ``TiedLayerSpec`` with the same ``key``.

    ``forward_fn(module, x)`` replaces ``module(x)`` at this position (e.g. ``lambda emb, h: h @
    emb.weight.t()`` for an LM head tied to the embedding). ``tied_weight_attr`` names the
    parameter(s), dotted paths inside the module, kept equal across stages.
    """

    def __init__(self, key: str, cls: Callable[..., nn.Module], *args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None,
                 tied_weight_attr: "str | Sequence[str]" = "weight", **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self.key = str(key)
        self.forward_fn = forward_fn
        attrs = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        if not attrs:
            raise ValueError(f"TiedLayerSpec(key={key!r}): tied_weight_attr names no parameter")
        self.tied_weight_attr = attrs


@dataclass(frozen=True)
class Tie:
    key: str
    members: tuple[tuple[int, str], ...]  # (layer index, parameter name inside that layer)
    #: True when the members are uses of one module (TiedLayerSpec): then every parameter of that
    #: module must be a member, or the stages' copies of the rest would drift apart.
    shares_module: bool = False

    @property
    def layers(self) -> list[int]:
        return sorted({i for i, _ in self.members})


def _as_module(layer: Any) -> Any:
    """A layer as a module to inspect: a spec is built on the meta device, which allocates nothing."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            return layer.build()
    return layer


def count_parameters(layer: Any) -> int:
    """Parameters of a layer (a spec's, built on the meta device)."""
    layer = _as_module(layer)
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    return 0


def _get_parameter(module: nn.Module, name: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError as err:
        raise ValueError(f"pipeline tie: {type(module).__name__} has no parameter {name!r} "
                         f"(its parameters: {[n for n, _ in module.named_parameters()]})") from err


class PipelineModule(nn.Module):
    def __init__(self, layers: Iterable[Any], num_stages: int,
                 partition_method: "str | Sequence[int]" = "parameters",
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 ties: Sequence[Tie] = (), layer_names: Sequence[str] | None = None) -> None:
        """``layer_names``: each layer's module path in the non-pipelined model (default: its
        index, as ``nn.Sequential`` names it); checkpoints use the names they give."""
        super().__init__()
        specs = list(layers)
        for i, layer in enumerate(specs):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"PipelineModule: layer {i} is {type(layer).__name__}; give a module, a "
                                "LayerSpec/TiedLayerSpec or a parameter-free callable")
        self.num_stages = int(num_stages)
        self.num_layers = len(specs)
        self.layer_names = _check_layer_names(layer_names, specs)
        weights = ([count_parameters(s) for s in specs] if partition_method == "parameters"
                   else [1] * len(specs))
        self.bounds = partition(weights, self.num_stages, partition_method)
        #: model chunks per stage (``set_virtual_stages``); layer cuts of the stages x chunks
        self.virtual_stages = 1
        self.chunk_bounds = self.bounds
        object.__setattr__(self, "_partition_args", (weights, partition_method))
        self.ties = tuple(sorted(_spec_ties(specs) + list(ties), key=lambda t: t.key))
        object.__setattr__(self, "loss_fn", loss_fn)  # a plain attribute: never part of state
        object.__setattr__(self, "_specs", specs)  # not registered: only owned layers become children
        self.stage: int | None = None
        self._forward_fns: list[Callable[[Any], Any]] = []
        self._chunk_fns: list[list[Callable[[Any], Any]]] = []  # the same, per chunk

    @classmethod
    def from_sequential(cls, sequential: nn.Sequential, num_stages: int,
                        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                        partition_method: "str | Sequence[int]" = "parameters") -> "PipelineModule":
        """Pipeline an existing ``nn.Sequential``; parameters shared between its layers become ties,
        and its children's names (``0``, ``1`` ... or an OrderedDict's) are the checkpoint's."""
        return cls.from_modules(list(sequential.named_children()), num_stages, loss_fn, partition_method)

    @classmethod
    def from_modules(cls, named_layers: Sequence[tuple[str, Any]], num_stages: int,
                     loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                     partition_method: "str | Sequence[int]" = "parameters") -> "PipelineModule":
        """Pipeline a model given as its layers in order, each with its module path in that model
        (``("blocks.0", block)``): the checkpoint keeps the model's names, and parameters shared
        between layers (a tied LM head) become ties whose checkpoint name is the first one's."""
        names = [n for n, _ in named_layers]
        layers = [layer for _, layer in named_layers]
        return cls(layers, num_stages, partition_method, loss_fn, ties=_shared_parameter_ties(layers),
                   layer_names=names)

    # ------------------------------------------------------------------ layout (pure)
    def set_virtual_stages(self, virtual_stages: int, partition_method: "str | Sequence[int] | None" = None) -> None:
        """Cut the layers into ``num_stages * virtual_stages`` chunks instead (before ``build``):
        stage ``s`` holds chunks ``s, s + num_stages, ...`` (interleaved 1F1B). ``partition_method``
        defaults to the module's; an explicit list at construction cuts stages, not chunks, so give
        the chunks' boundaries here. Names stay the Sequential's."""
        if self.is_built:
            raise RuntimeError(f"PipelineModule is built for stage {self.stage}: set virtual stages before build()")
        weights, method = self._partition_args
        chunks = self.num_stages * int(virtual_stages)
        if partition_method is None and not isinstance(method, str) and virtual_stages > 1:
            raise ValueError(f"partition_method={list(method)!r} cuts {self.num_stages} stages, not {chunks} chunks "
                             f"(virtual_stages={virtual_stages}); valid: partition_method='parameters' or "
                             f"'uniform', or the chunk boundaries in set_virtual_stages({virtual_stages}, [...])")
        method = method if partition_method is None else partition_method
        self.chunk_bounds = partition(weights, chunks, method) if virtual_stages > 1 else self.bounds
        self.virtual_stages = int(virtual_stages)

    def stage_of_layer(self, index: int) -> int:
        return stage_of_layer(self.chunk_bounds, index) % self.num_stages

    def chunk_layers(self, stage: int) -> list[range]:
        """The layers of each of ``stage``'s chunks, chunk 0 first (one range without virtual stages)."""
        p, b = self.num_stages, self.chunk_bounds
        return [range(b[c * p + stage], b[c * p + stage + 1]) for c in range(self.virtual_stages)]

    def layer_range(self, stage: int) -> "range | list[int]":
        """The layers ``stage`` holds (a range without virtual stages)."""
        chunks = self.chunk_layers(stage)
        return chunks[0] if len(chunks) == 1 else [i for r in chunks for i in r]

    def tie_owner_stages(self, tie: Tie) -> list[int]:
        return sorted({self.stage_of_layer(i) for i in tie.layers})

    def owner_stages_of_key(self, key: str) -> list[int]:
        """Stages holding a state-dict key such as ``3.weight`` (more than one for a tied layer)."""
        head = key.split(".", 1)[0]
        if not head.isdigit() or int(head) >= self.num_layers:
            raise KeyError(f"{key!r} does not name a layer of this {self.num_layers}-layer pipeline")
        index = int(head)
        stages = {self.stage_of_layer(index)}
        for tie in self.ties:
            if index in tie.layers:
                stages.update(self.tie_owner_stages(tie))
        return sorted(stages)

    def plain_key(self, key: str) -> str:
        """A key of this module (``3.attn.c_attn.weight``) as the non-pipelined model names it."""
        head, _, rest = key.partition(".")
        if not head.isdigit() or int(head) >= self.num_layers:
            raise KeyError(f"{key!r} does not name a layer of this {self.num_layers}-layer pipeline")
        name = self.layer_names[int(head)]
        return f"{name}.{rest}" if rest else name

    def canonical_key(self, key: str) -> str:
        """The plain key a parameter is checkpointed under: a tied parameter's is its first
        member's (the lowest layer), the name the plain model yields first."""
        tie = self._tie_of(key)
        if tie is None:
            return self.plain_key(key)
        index, name = min(tie.members)
        return self.plain_key(f"{index}.{name}")

    def saves_key(self, key: str) -> bool:
        """Whether this stage writes the parameter ``key`` to a checkpoint: a tied one only on its
        lowest owning stage (the one its broadcast starts from), so it is saved once. With
        virtual stages that reads the chunk cut: the first member's chunk may sit on a higher stage."""
        tie = self._tie_of(key)
        return tie is None or self.tie_owner_stages(tie)[0] == self.stage

    def _tie_of(self, key: str) -> Tie | None:
        head, _, rest = key.partition(".")
        if not head.isdigit():
            return None
        return next((t for t in self.ties if (int(head), rest) in t.members), None)

    # ------------------------------------------------------------------ this stage
    @property
    def is_built(self) -> bool:
        return self.stage is not None

    def build(self, stage: int) -> None:
        """Construct (or keep) the layers of ``stage``; drop every other layer."""
        if self.is_built:
            if stage != self.stage:
                raise RuntimeError(f"PipelineModule already built for stage {self.stage}, not {stage}")
            return
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} outside 0..{self.num_stages - 1}")
        shared: dict[str, nn.Module] = {}
        for layers in self.chunk_layers(stage):
            self._chunk_fns.append([])
            for i in layers:
                layer = self._specs[i]
                if isinstance(layer, TiedLayerSpec):
                    module = shared.get(layer.key) or layer.build()
                    shared[layer.key] = module
                    fn = functools.partial(layer.forward_fn, module) if layer.forward_fn else module
                elif isinstance(layer, LayerSpec):
                    module = fn = layer.build()
                else:
                    module = fn = layer
                if isinstance(module, nn.Module):
                    self.add_module(str(i), module)
                self._forward_fns.append(fn)
                self._chunk_fns[-1].append(fn)
        self.stage = stage
        self._check_ties()
        object.__setattr__(self, "_specs", None)  # release the layers other stages own

    def follow_replaced_layers(self, replaced: Mapping[int, nn.Module]) -> None:
        """After layers of this stage were replaced in place (a tensor-parallel cut swaps a layer
        for its parallel form under the same name), run the new ones: ``replaced`` maps
        ``id(old module)`` to its replacement, in this stage's forward (and a tied layer's
        ``forward_fn``)."""
        def swap(fn: Any) -> Any:
            if isinstance(fn, functools.partial) and fn.args and id(fn.args[0]) in replaced:
                return functools.partial(fn.func, replaced[id(fn.args[0])], *fn.args[1:], **fn.keywords)
            return replaced.get(id(fn), fn)

        self._forward_fns = [swap(fn) for fn in self._forward_fns]
        self._chunk_fns = [[swap(fn) for fn in chunk] for chunk in self._chunk_fns]

    def _check_ties(self) -> None:
        for tie in self.ties:
            if not tie.shares_module or len(self.tie_owner_stages(tie)) < 2:
                continue
            for i in tie.layers:
                if i not in self.layer_range(self.stage):
                    continue
                tied = {name for j, name in tie.members if j == i}
                layer = getattr(self, str(i))
                for name, _ in layer.named_parameters():
                    if name not in tied and not self._tied_elsewhere(i, name):
                        raise ValueError(
                            f"pipeline tie {tie.key!r}: layer {i} ({type(layer).__name__}) spans stages "
                            f"{self.tie_owner_stages(tie)} but its parameter {name!r} is not tied, so its "
                            f"copies would diverge; add {name!r} to tied_weight_attr")

    def _tied_elsewhere(self, index: int, name: str) -> bool:
        return any((index, name) in t.members for t in self.ties)

    def tied_parameters(self, tie: Tie) -> list[nn.Parameter]:
        """This stage's copy of a tie's parameters (empty if the stage holds none)."""
        self._require_built()
        out: dict[int, nn.Parameter] = {}
        for i, name in tie.members:
            if i in self.layer_range(self.stage):
                p = _get_parameter(getattr(self, str(i)), name)
                out[id(p)] = p
        return list(out.values())

    def stage_state_dict(self, full: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """The entries of a non-pipelined state dict (keys ``prefix + "3.weight"``) that this
        stage holds, ready for ``load_state_dict``; raises if one is missing."""
        self._require_built()
        own = {prefix + k for k in self.state_dict().keys()}
        missing = sorted(own - set(full))
        if missing:
            raise KeyError(f"stage {self.stage}: the state dict lacks {missing}")
        return {k[len(prefix):]: full[k] for k in own}

    def forward(self, x: Any) -> Any:
        self._require_built()
        for fn in self._forward_fns:
            x = fn(x)
        return x

    def forward_chunk(self, chunk: int, x: Any) -> Any:
        """The layers of one of this stage's chunks (``set_virtual_stages``)."""
        self._require_built()
        for fn in self._chunk_fns[chunk]:
            x = fn(x)
        return x

    def _require_built(self) -> None:
        if not self.is_built:
            raise RuntimeError("PipelineModule is not built: train it with strategy='pipeline' or call "
                               ".build(stage) first")

    def extra_repr(self) -> str:
        chunks = f", virtual_stages={self.virtual_stages}, chunk_bounds={self.chunk_bounds}" if self.virtual_stages > 1 else ""
        return f"stage={self.stage}, num_stages={self.num_stages}, bounds={self.bounds}{chunks}"


def _check_layer_names(names: Sequence[str] | None, specs: list[Any]) -> tuple[str, ...]:
    """The layers' paths. Two layers may share one (halves of one module cut by a stage boundary:
    ``blocks.4`` holding ``ln_1``/``attn``, then ``blocks.4`` holding ``ln_2``/``mlp``) as long as
    their state keys under it stay distinct."""
    num_layers = len(specs)
    if names is None:
        return tuple(str(i) for i in range(num_layers))
    names = tuple(str(n) for n in names)
    if len(names) != num_layers or not all(names):
        raise ValueError(f"PipelineModule: layer_names={list(names)!r}; valid: {num_layers} non-empty "
                         "module paths, one per layer")
    counts = Counter(names)
    holder: dict[tuple[str, str], int] = {}  # (shared path, state key) -> the layer holding it
    for i, name in enumerate(names):
        if counts[name] == 1:
            continue
        module = _as_module(specs[i])
        for key in sorted(module.state_dict()) if isinstance(module, nn.Module) else ():
            j = holder.setdefault((name, key), i)
            if j != i:
                raise ValueError(f"PipelineModule: layer_names={list(names)!r}: layers {j} and {i} are both "
                                 f"{name!r} and both hold {key!r}; valid: distinct module paths, "
                                 "or one path shared by layers whose parameters and buffers have distinct "
                                 "names under it")
    return names


def _spec_ties(specs: list[Any]) -> list[Tie]:
    by_key: dict[str, list[tuple[int, str]]] = {}
    first: dict[str, TiedLayerSpec] = {}
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            ref = first.setdefault(spec.key, spec)
            if (spec.cls, spec.args, spec.kwargs) != (ref.cls, ref.args, ref.kwargs):
                raise ValueError(f"TiedLayerSpec(key={spec.key!r}) at layer {i} builds a different module "
                                 "than its first use; every use of a key must give the same class and args")
            by_key.setdefault(spec.key, []).extend((i, a) for a in spec.tied_weight_attr)
    return [Tie(k, tuple(m), shares_module=True) for k, m in by_key.items()]


def _shared_parameter_ties(layers: list[Any]) -> list[Tie]:
    owners: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Module):
            for name, p in layer.named_parameters(remove_duplicate=False):
                owners.setdefault(id(p), []).append((i, name))
    return [Tie(f"shared:{m[0][0]}.{m[0][1]}", tuple(m)) for m in owners.values()
            if len({i for i, _ in m}) > 1]


def find_pipeline_module(module: nn.Module, num_stages: int | None = None) -> PipelineModule:
    """The first PipelineModule inside ``module``; without one, what ``module.to_pipeline(num_stages)``
    returns (a TrainModule whose model is not a PipelineModule cuts itself: the demo GPT), which
    must be inside ``module`` by then."""
    for m in module.modules():
        if isinstance(m, PipelineModule):
            return m
    to_pipeline = getattr(module, "to_pipeline", None)
    if callable(to_pipeline) and num_stages is not None:
        pipe = to_pipeline(num_stages)
        if not isinstance(pipe, PipelineModule) or not any(m is pipe for m in module.modules()):
            raise TypeError(f"strategy='pipeline': {type(module).__name__}.to_pipeline({num_stages}) returned "
                            f"{type(pipe).__name__}; valid: a PipelineModule it holds as an attribute")
        return pipe
    raise ValueError(f"strategy='pipeline' needs a PipelineModule inside {type(module).__name__} (as an "
                     "attribute, built in __init__ or configure_model) or a to_pipeline(num_stages) method "
                     "returning one; none was found")
