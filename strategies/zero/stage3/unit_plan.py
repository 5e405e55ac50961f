"""Which parameters ZeRO-3 communicates together: the *unit* plan, a pure function of the module
tree (it works on a meta-device or placeholder model and needs no process group).

A *unit* is a module whose parameters are all-gathered before its forward and freed after it. By
default the units are the children of every ``nn.ModuleList`` (the transformer blocks of GPT-2,
Llama, the demo GPT ...); ``unit_modules`` may instead name module classes, or be a callable
``(qualified_name, module) -> bool``. Everything that is in no unit belongs to the *root unit*,
gathered for the whole step (embeddings, final norm, LM head).

Where a parameter goes:

* a parameter registered under one module belongs to the nearest unit enclosing that module;
* a parameter registered under several modules (a tied embedding and LM head) belongs to the
  nearest unit enclosing *all* of them, so it is gathered whenever any of its users runs;
* a floating-point parameter of at most ``persistence_threshold`` elements is *persistent*: whole
  on every rank, never gathered (its gradient is all-reduced, its optimizer state still sharded);
* a non-floating-point parameter is left alone (replicated, not trained);
* an expert parameter (moe/: ``allreduce = False`` with an expert-parallel ``group_name`` other
  than ``ep_size_1``) is never in a unit with parameters of another kind: the topmost modules whose
  parameters are all experts of one group are units of their own (kind = that ``group_name``), so
  the strategy partitions, gathers and reduces them over their expert-data-parallel group; a unit
  left mixing kinds (an expert parameter registered beside dense ones) is refused.

Inside a unit, parameters keep ``named_parameters()`` order; :func:`optimizer_runs` maps a rank's
partition of a unit onto the optimizer's param groups.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from torch import nn

from ..layout import GroupLayout

log = logging.getLogger("zerotrain")

UnitPolicy = Callable[[str, nn.Module], bool]
ROOT = ""
PERSISTENT = "<persistent>"


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its module path (``""`` for the root, ``"<persistent>"`` for the small
    parameters) and its parameters' canonical names, in layout order."""

    name: str
    params: tuple[str, ...]
    #: ``None`` for dense parameters, else the experts' ``group_name`` (``"ep_size_<n>"``)
    kind: str | None = None

    @property
    def persistent(self) -> bool:
        return self.name == PERSISTENT

    @property
    def is_root(self) -> bool:
        return self.name == ROOT


@dataclass(frozen=True)
class UnitPlan:
    units: tuple[UnitSpec, ...]  # the root first, then units in module order, persistent last
    unmanaged: tuple[str, ...]  # non-floating-point parameters, left replicated
    #: every name a managed parameter is registered under -> its canonical (first) name
    aliases: dict[str, str]

    def unit_of(self) -> dict[str, str]:
        """canonical parameter name -> unit name"""
        return {p: u.name for u in self.units for p in u.params}


def make_policy(unit_modules: "Sequence[str] | UnitPolicy | None") -> UnitPolicy | None:
    """``None`` (the default: children of every ``nn.ModuleList``), class names, or a callable."""
    if unit_modules is None:
        return None
    if callable(unit_modules):
        return unit_modules
    if isinstance(unit_modules, str) or not all(isinstance(n, str) for n in unit_modules):
        raise TypeError(f"zero3: unit_modules={unit_modules!r} must be a list of module class names, "
                        "a callable (name, module) -> bool, or None")
    names = frozenset(unit_modules)
    if not names:
        raise ValueError("zero3: unit_modules=[] names no class: give class names, or None for the "
                         "default (the children of every nn.ModuleList)")
    return _ClassNames(names)


class _ClassNames:
    """The policy of ``unit_modules=[class names]``: a module of one of those classes is a unit."""

    def __init__(self, names: frozenset[str]) -> None:
        self.class_names = names

    def __call__(self, name: str, module: nn.Module) -> bool:
        return type(module).__name__ in self.class_names


def plan_units(root: nn.Module, policy: UnitPolicy | None = None,
               persistence_threshold: int = 0) -> UnitPlan:
    """The unit plan of ``root`` (see the module docstring); ``policy=None`` is the default."""
    if persistence_threshold < 0:
        raise ValueError(f"persistence_threshold={persistence_threshold} must be >= 0")
    named = getattr(policy, "class_names", None)
    if named:  # misspelt classes would silently make the whole model one unit, gathered at once
        present = {type(m).__name__ for m in root.modules()}
        if not named & present:
            raise ValueError(f"zero3: unit_modules={sorted(named)} names no module class of the model; its "
                             f"module classes: {', '.join(sorted(present))}")
        if named - present:  # a list written for several models: say which names found nothing
            log.warning("zero3: unit_modules names %s, which no module of this model is",
                        ", ".join(sorted(named - present)))
    if policy is None:
        in_lists = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m.children()}
        policy = lambda name, module: id(module) in in_lists  # noqa: E731
    expert_roots = _expert_roots(root)
    if expert_roots:
        given = policy
        policy = lambda name, module: id(module) in expert_roots or given(name, module)  # noqa: E731
    unit_chain = _unit_chains(root, policy)  # module path -> unit paths from the root down
    owners: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    aliases: dict[str, str] = {}
    id_of: dict[str, int] = {}
    for full_name, p in root.named_parameters(remove_duplicate=False):
        id_of.setdefault(full_name, id(p))
        module_path = full_name.rpartition(".")[0]
        owners.setdefault(id(p), []).append(module_path)
        first_name.setdefault(id(p), full_name)
        params[id(p)] = p
        aliases[full_name] = first_name[id(p)]
    members: dict[str, list[str]] = {name: [] for name in _unit_names(unit_chain)}
    members[PERSISTENT] = []
    unmanaged = []
    for pid, name in first_name.items():  # named_parameters order
        p = params[pid]
        if not p.is_floating_point():
            unmanaged.append(name)
        elif p.numel() <= persistence_threshold and expert_kind(p) is None:
            members[PERSISTENT].append(name)
        else:
            members[_common_unit([unit_chain[m] for m in owners[pid]])].append(name)
    units = tuple(UnitSpec(n, tuple(ps), _kind_of(n, [params[id_of[q]] for q in ps]))
                  for n, ps in members.items() if ps or n == ROOT)  # the root is kept even when empty
    aliases = {k: v for k, v in aliases.items() if v not in unmanaged}
    return UnitPlan(units, tuple(unmanaged), aliases)


def expert_kind(p: nn.Parameter) -> str | None:
    """The expert-parallel group name of an expert parameter (moe/'s marks), None for a dense one
    (experts of ``ep_size_1`` are replicated over the world, as dense ones)."""
    if getattr(p, "allreduce", True) is not False:
        return None
    name = getattr(p, "group_name", "ep_size_1")
    return None if name == "ep_size_1" else name


def _expert_roots(root: nn.Module) -> set[int]:
    """ids of the topmost modules whose parameters (with their children's) are all experts of one
    group."""
    kinds: dict[int, set] = {}

    def walk(m: nn.Module) -> set:
        mine = {expert_kind(p) for p in m.parameters(recurse=False)}
        for child in m.children():
            mine |= walk(child) if id(child) not in kinds else kinds[id(child)]
        kinds[id(m)] = mine
        return mine

    walk(root)
    out: set[int] = set()

    def pick(m: nn.Module) -> None:
        k = kinds[id(m)]
        if len(k) == 1 and None not in k:
            out.add(id(m))
            return
        for child in m.children():
            pick(child)

    pick(root)
    return out


def _kind_of(unit: str, params: list[nn.Parameter]) -> str | None:
    kinds = {expert_kind(p) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"zero3: unit {unit or 'root'!r} holds parameters of kinds {sorted(map(str, kinds))} "
                         "(dense and expert-parallel); valid: expert parameters in a module that holds no "
                         "dense ones (e.g. the MoE layer's experts container)")
    return kinds.pop() if kinds else None


def _unit_chains(root: nn.Module, policy: UnitPolicy) -> dict[str, tuple[str, ...]]:
    chains: dict[str, tuple[str, ...]] = {}

    def walk(module: nn.Module, path: str, chain: tuple[str, ...]) -> None:
        if path and policy(path, module):
            chain = chain + (path,)
        chains[path] = chain
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            if child_path not in chains:
                walk(child, child_path, chain)

    walk(root, ROOT, (ROOT,))
    return chains


def _unit_names(chains: dict[str, tuple[str, ...]]) -> list[str]:
    seen: dict[str, None] = {ROOT: None}
    for chain in chains.values():  # module order
        for u in chain:
            seen.setdefault(u, None)
    return list(seen)


def _common_unit(chains: Iterable[tuple[str, ...]]) -> str:
    """The deepest unit that encloses every chain (the root when they share no other)."""
    chains = list(chains)
    common = chains[0]
    for c in chains[1:]:
        n = 0
        while n < min(len(common), len(c)) and common[n] == c[n]:
            n += 1
        common = common[:n]
    return common[-1]


@dataclass(frozen=True)
class Run:
    """``numel`` elements at ``start`` of a rank's partition of a unit, all in optimizer
    param group ``group``."""

    group: int
    start: int
    numel: int


def optimizer_runs(layout: GroupLayout, rank: int, group_of: Sequence[int | None]) -> list[Run]:
    """Cut ``rank``'s partition of a unit into maximal runs of one optimizer group each.
    ``group_of[i]`` is parameter i's group, or None for a parameter no optimizer steps (frozen);
    padding and frozen parameters are in no run."""
    if len(group_of) != len(layout.spans):
        raise ValueError(f"{len(group_of)} group ids for {len(layout.spans)} parameters")
    runs: list[Run] = []
    for piece in layout.pieces(rank):
        g = group_of[piece.index]
        if g is None:
            continue
        last = runs[-1] if runs else None
        if last is not None and last.group == g and last.start + last.numel == piece.partition_start:
            runs[-1] = Run(g, last.start, last.numel + piece.numel)
        else:
            runs.append(Run(g, piece.partition_start, piece.numel))
    return runs
