"""Tensor-parallel plans: ``parallelize_tensor(model, group, plan)`` replaces each planned module
by its tensor-parallel form on plain local parameters (``tensor.py``), under the same names.

A plan maps module paths (``*`` matches one path component: ``blocks.*.attn.c_attn``) to a style
in one of three vocabularies, all taken as input:

* Hugging Face ``tp_plan`` strings: ``colwise``, ``rowwise``, ``colwise_rep`` /
  ``colwise_gather_output``, ``rowwise_rep``, ``packed_colwise`` (a fused projection of 2 blocks,
  gate and up), ``embedding_rowwise`` (the vocabulary-parallel embedding);
* ``(style, chunks)``: a fused projection of ``chunks`` blocks, each split (``("packed_colwise", 3)``:
  a fused q/k/v);
* torch's ``ColwiseParallel()`` / ``RowwiseParallel()`` (``torch.distributed.tensor.parallel``), read
  for their layouts: input Replicate and output Shard(-1) is ``colwise``, output Replicate
  ``colwise_rep``; input Shard(-1) is ``rowwise``, input Replicate ``rowwise_rep``;
  ``RowwiseParallel`` on an ``nn.Embedding`` is ``embedding_rowwise``, as torch shards it.

The sequence-parallel variant (``tensor_sequence.py``; the activations between a row-parallel output
and the next column-parallel input cut along the sequence, dimension 1): ``colwise_sp`` (input
Shard(1): gathered first), ``rowwise_sp`` (output Shard(1): reduce-scattered), ``embedding_rowwise_sp``
(the rows reduce-scattered), ``sequence_parallel`` (a norm or an ``nn.Dropout`` run on the shard;
Hugging Face's name), ``sequence_shard`` (the same from a replicated input, cut first). torch's
``SequenceParallel()`` (sequence_dim 1), ``ColwiseParallel(input_layouts=Shard(1))``,
``RowwiseParallel(output_layouts=Shard(1))`` and an embedding's ``RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))`` are read as these. A plan with them is the switch: the demo GPT's is
``GPT.tp_plan_sequence_parallel`` (``GPTConfig.tp_sequence_parallel``).

A ``colwise``/``rowwise`` entry (not the sequence-parallel ones) may name a Hugging Face ``Conv1D``
(GPT-2's projections, weight stored ``[in, out]``): ``tensor_conv1d.ParallelConv1D`` cuts it in its
own layout.

With no plan, the model's own: ``model.tp_plan`` (a Hugging Face model's, from its config's
``base_model_tp_plan`` and its ``_tp_plan``), else ``model._tp_plan``. A model with none can have
one found by name and shape (``tensor_auto.plan_by_shape``; DeepSpeed's AutoTP face uses it).

Refused before any module changes: a style outside these, a pattern that matches no module, a
module of the wrong type, and a tied parameter whose other module the plan leaves whole.
"""
from __future__ import annotations

import re
import warnings

import torch
from torch import nn

from .tensor import ParallelLinear, VocabParallelEmbedding, full_tensor
from .tensor_conv1d import ParallelConv1D, is_conv1d
from .tensor_sequence import give_tensor_rng, is_norm, sequence_parallel_module

#: Hugging Face's names -> (our style, packed blocks)
STYLES = {"colwise": ("colwise", 1), "colwise_rep": ("colwise_rep", 1), "colwise_gather_output": ("colwise_rep", 1),
          "rowwise": ("rowwise", 1), "rowwise_rep": ("rowwise_rep", 1), "packed_colwise": ("colwise", 2),
          "embedding_rowwise": ("embedding_rowwise", 1), "colwise_sp": ("colwise_sp", 1), "rowwise_sp": ("rowwise_sp", 1),
          "embedding_rowwise_sp": ("embedding_rowwise_sp", 1), "sequence_parallel": ("sequence_parallel", 1),
          "sequence_shard": ("sequence_shard", 1)}
#: the styles that run a module on this rank's sequence shard (a norm, a dropout), cutting no parameter
SEQUENCE_STYLES = ("sequence_parallel", "sequence_shard")


def _torch_style(spec, module: nn.Module) -> tuple[str, int]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    def one(layouts):
        return layouts[0] if isinstance(layouts, (tuple, list)) else layouts

    def is_last(layout) -> bool:
        return isinstance(layout, Shard) and layout.dim == -1

    def is_seq(layout) -> bool:
        return isinstance(layout, Shard) and layout.dim == 1

    name = type(spec).__name__
    if isinstance(spec, SequenceParallel):
        if spec.sequence_sharding != (Shard(1),):
            raise NotImplementedError(f"tensor plan: SequenceParallel(sequence_dim={spec.sequence_sharding[0].dim}) "
                                      f"is not supported; valid: sequence_dim=1 ([batch, sequence, ...] activations)")
        return "sequence_parallel", 1
    if not getattr(spec, "use_local_output", True):
        raise NotImplementedError(f"tensor plan: {name}(use_local_output=False) gives DTensors; zerotrain's "
                                  f"tensor parallelism keeps plain local tensors (use_local_output=True)")
    inp, out = one(spec.input_layouts), one(spec.output_layouts)
    if isinstance(spec, RowwiseParallel) and isinstance(module, nn.Embedding):
        if isinstance(inp, Replicate) and (isinstance(out, Replicate) or is_seq(out)):
            return "embedding_rowwise" + ("_sp" if is_seq(out) else ""), 1
    elif isinstance(spec, ColwiseParallel) and (isinstance(inp, Replicate) or is_seq(inp)):
        if is_last(out):
            return "colwise" + ("_sp" if is_seq(inp) else ""), 1
        if isinstance(out, Replicate) and isinstance(inp, Replicate):
            return "colwise_rep", 1
    elif isinstance(spec, RowwiseParallel) and is_seq(out) and is_last(inp):
        return "rowwise_sp", 1
    elif isinstance(spec, RowwiseParallel) and isinstance(out, Replicate):
        if is_last(inp):
            return "rowwise", 1
        if isinstance(inp, Replicate):
            return "rowwise_rep", 1
    raise NotImplementedError(f"tensor plan: {name}(input_layouts={inp}, output_layouts={out}) on "
                              f"{type(module).__name__} is not supported; valid: ColwiseParallel with input "
                              f"Replicate or Shard(1) and output Shard(-1) (or Replicate from Replicate), "
                              f"RowwiseParallel with output Replicate, or Shard(1) from Shard(-1); SequenceParallel()")


def resolve_style(spec, module: nn.Module, where: str) -> tuple[str, int]:
    """``(style, chunks)`` of one plan entry for ``module``, or a clear error naming ``where``."""
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], int) and spec[1] >= 1:
        style, _ = resolve_style(spec[0], module, where)
        return style, spec[1]
    if isinstance(spec, str):
        if spec not in STYLES:
            raise ValueError(f"tensor plan: {where!r}: {spec!r}; valid: {', '.join(STYLES)}")
        style, chunks = STYLES[spec]
    elif type(spec).__module__.startswith("torch.distributed.tensor.parallel"):
        style, chunks = _torch_style(spec, module)
    else:
        raise ValueError(f"tensor plan: {where!r}: {spec!r}; valid: one of {', '.join(STYLES)}, (style, chunks), "
                         f"ColwiseParallel(), RowwiseParallel()")
    if style in SEQUENCE_STYLES:
        if type(module) is not nn.Dropout and not is_norm(module):
            raise ValueError(f"tensor plan: {where!r} is a {type(module).__name__}; {style} applies to an nn.Dropout "
                             f"or a norm (a ...Norm class with parameters of its own, no submodules)")
        return style, chunks
    if style.startswith("embedding_rowwise"):
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tensor plan: {where!r} is a {type(module).__name__}; {style} applies to an nn.Embedding")
    elif is_conv1d(module):
        if style not in ParallelConv1D.STYLES:
            raise ValueError(f"tensor plan: {where!r} is a Hugging Face Conv1D; {style} applies to an nn.Linear (a "
                             f"Conv1D takes {', '.join(ParallelConv1D.STYLES)})")
    elif not isinstance(module, nn.Linear):
        raise ValueError(f"tensor plan: {where!r} is a {type(module).__name__}; {style} applies to an nn.Linear "
                         f"(or a Hugging Face Conv1D)")
    return style, chunks


def plan_of(model: nn.Module) -> dict:
    """The model's own plan: ``model.tp_plan`` (Hugging Face), else ``model._tp_plan``; for a
    module that declares none (a TrainModule holding a model), its outermost submodules' plans,
    each key prefixed by the submodule's path."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    out: dict = {}
    for name, child in model.named_children():
        out.update({f"{name}.{key}": spec for key, spec in plan_of(child).items()})
    return out


def sequence_parallel_keys(plan: dict) -> list[str]:
    """The keys of ``plan`` whose style is of the sequence-parallel variant (``_sp``, ``sequence_*``,
    torch's ``SequenceParallel``), sorted; for a strategy that does not take it."""
    def style(spec) -> str:
        spec = spec[0] if isinstance(spec, tuple) else spec
        return spec if isinstance(spec, str) else type(spec).__name__

    return sorted(k for k, spec in plan.items()
                  if style(spec).endswith("_sp") or style(spec) in (*SEQUENCE_STYLES, "SequenceParallel"))


def _pattern(key: str) -> re.Pattern:
    return re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*")))


def parallelize_tensor(model: nn.Module, group, plan: dict | None = None) -> dict[str, str]:
    """Cut ``model``'s planned modules over ``group`` (in place); returns ``{module path: style}``
    of what was cut. ``plan``: see the module's doc; None: the model's own."""
    plan = plan_of(model) if plan is None else dict(plan)
    if not plan:
        raise ValueError(f"parallelize_tensor: no plan given and {type(model).__name__} has none "
                         f"(tp_plan / _tp_plan); valid: a dict of module path -> style")
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, int]] = {}
    for key, spec in plan.items():
        pattern = _pattern(key)
        hits = [name for name in modules if name and pattern.fullmatch(name)]
        if not hits:
            raise ValueError(f"tensor plan: {key!r} matches no module of {type(model).__name__}")
        for name in hits:
            chosen[name] = resolve_style(spec, modules[name], key)
    _check_ties(model, modules, chosen)
    shared: dict = {}
    replaced = {id(p) for name, (style, _) in chosen.items() if style not in SEQUENCE_STYLES
                for p in modules[name].parameters(recurse=False)}  # a sequence-parallel norm keeps its own
    for name, (style, chunks) in chosen.items():
        old = modules[name]
        if style in SEQUENCE_STYLES:
            new = sequence_parallel_module(old, group, entry=style == "sequence_shard")
        elif style.startswith("embedding_rowwise"):
            new = VocabParallelEmbedding(old, group, shared, sequence_output=style.endswith("_sp"))
        else:
            new = (ParallelConv1D if is_conv1d(old) else ParallelLinear)(old, style, group, chunks, shared)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    replaced -= {id(p) for p in model.parameters()}  # a row-parallel layer keeps its bias whole: the same Parameter
    model._tensor_parallel_replaced = frozenset(replaced)  # for refuse_stale_optimizer
    give_tensor_rng(model, group)  # dropout inside the tensor-parallel regions: a stream per rank
    return {name: style for name, (style, _) in chosen.items()}


def _check_ties(model: nn.Module, modules: dict, chosen: dict) -> None:
    """A parameter shared by a planned module and one left whole would be cut in one and not the
    other: refused, naming both."""
    owners: dict[int, list[str]] = {}
    for name, module in modules.items():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for names in owners.values():
        cut = [n for n in names if n.rpartition(".")[0] in chosen]
        if cut and len(cut) != len(names):
            whole = sorted(set(names) - set(cut))
            raise ValueError(f"tensor plan: {cut[0]} is tied to {whole[0]}, which the plan leaves whole; "
                             f"valid: plan both (embedding_rowwise with colwise) or untie them")


# ---------------------------------------------------------------------------- a strategy's side
def is_cut(module: nn.Module) -> bool:
    """Whether ``module`` holds tensor-parallel parameters."""
    return any(hasattr(p, "tensor_parallel") for p in module.parameters())


def cut_for_mesh(strategy) -> None:
    """At a strategy's ``setup_module``: its module cut by the module's own plan over the mesh's
    tensor group (nothing without a tensor axis), before anything flattens or wraps its parameters.
    A module cut already (the DeepSpeed face cuts before building the optimizer) is left as is; a
    module with no plan at all stays whole on every tensor rank (each computes the same), with a
    warning."""
    if strategy.mesh_size("tensor") == 1 or is_cut(strategy.module):
        return
    if not plan_of(strategy.module):
        warnings.warn(f"tensor_parallel={strategy.mesh_size('tensor')}: {type(strategy.module).__name__} declares no "
                      f"tp_plan (in itself or a submodule); nothing is cut: every tensor rank holds the whole model")
        return
    parallelize_tensor(strategy.module, strategy.mesh_group("tensor"))


def refuse_stale_optimizer(module: nn.Module, optimizer) -> None:
    """ValueError where ``optimizer`` holds a parameter the tensor-parallel cut replaced (an
    optimizer built before the module was set up would step what no longer computes)."""
    replaced = getattr(module, "_tensor_parallel_replaced", frozenset())
    if any(id(p) in replaced for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("tensor parallelism: the optimizer holds parameters the tensor-parallel cut replaced; "
                         "valid: build the optimizer from the module after it is set up (its local shards)")


def gather_full_state(strategy, state: dict) -> dict:
    """Collective over the tensor group: ``state`` (the strategy's full state dict, ``{}`` off rank
    0) with every tensor-parallel parameter gathered whole from the module (its current values)."""
    group = strategy.mesh_group("tensor")
    if group is None:
        return state
    low = [n for n, p in strategy.module.named_parameters() if hasattr(p, "tensor_parallel") and p.dtype != torch.float32]
    if low:  # the working copies are rounded; the state dict promises the fp32 masters
        raise NotImplementedError(f"full_state_dict of tensor-parallel parameter {low[0]!r} held in "
                                  f"{strategy.module.get_parameter(low[0]).dtype}: gathering the fp32 masters of "
                                  "tensor-parallel shards is not built yet; valid: precision 32 (or bf16-mixed "
                                  "under ddp, whose parameters stay fp32)")
    whole = {n: full_tensor(p, group).cpu() for n, p in strategy.module.named_parameters(remove_duplicate=False)
             if hasattr(p, "tensor_parallel")}
    return {k: whole.get(k, v) for k, v in state.items()}


def join_shards(module: nn.Module, values: dict[int, torch.Tensor], group, device) -> dict[int, torch.Tensor]:
    """Collective over the tensor group ``group``: ``values`` (tensors by parameter id, each shaped
    as this rank's local parameter: ZeRO-3's gathered fp32 masters) with each tensor-parallel
    parameter's joined whole from its ranks' parts (on the CPU)."""
    out = dict(values)
    for _, p in module.named_parameters():
        if hasattr(p, "tensor_parallel") and id(p) in values:
            out[id(p)] = full_tensor((p, values[id(p)].to(device)), group).cpu()
    return out


def plan_split(model: nn.Module, plan: dict | None = None) -> tuple[int, int]:
    """``(sharded, replicated)`` parameter elements of the whole ``model`` under ``plan`` (None:
    its own), as ``parallelize_tensor`` would cut them: planned modules' weights and column-parallel
    biases are cut, everything else stays whole; a tied parameter counts once. For the memory
    estimate (``memory/mesh.py``); nothing is changed."""
    plan = plan_of(model) if plan is None else dict(plan)
    modules = dict(model.named_modules())
    cut: set[int] = set()
    for key, spec in plan.items():
        pattern = _pattern(key)
        for name in (n for n in modules if n and pattern.fullmatch(n)):
            style, _ = resolve_style(spec, modules[name], key)
            module = modules[name]
            if not style.startswith(("colwise", "rowwise", "embedding_rowwise")):
                continue  # a norm or dropout run on the sequence shard: its parameters stay whole
            cut.add(id(module.weight))
            if style.startswith("colwise") and getattr(module, "bias", None) is not None:
                cut.add(id(module.bias))
    params = {id(p): p.numel() for p in model.parameters()}
    sharded = sum(n for i, n in params.items() if i in cut)
    return sharded, sum(params.values()) - sharded
