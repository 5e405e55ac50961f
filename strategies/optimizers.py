"""Several user optimizers seen by a strategy as one: :class:`OptimizerSet`.

Why a composite rather than a list in every strategy: a strategy lays out, partitions, clips,
steps and checkpoints *param groups*; it never needs to know which optimizer a group came from,
except to step or zero one optimizer alone. So the set exposes the concatenation of its
optimizers' param groups (the same dict objects: when ZeRO or offload re-target
``group["params"]`` onto fp32 master slices, each user optimizer steps those slices), one merged
``state`` and one ``state_dict()`` in torch's layout over the concatenated groups (parameter
indices numbered across all of them). The per-parameter checkpoint format, ``split_optimizer_state``
and the ZeRO layouts therefore stay what they are for one optimizer, and a checkpoint of a
several-optimizer run resumes exactly.

A parameter may be in several optimizers (Lightning allows it: GAN-style toggling, two learning
rates on one layer); each keeps its own state for it and steps it when it steps. A replicated
strategy checkpoints those states side by side (:func:`param_states` names the state of every
owner after the first with a suffix ``@1``, ``@2``..., :func:`state_slots` maps them back); a strategy that
partitions each parameter's optimizer state once (ZeRO) refuses such a set
(``Strategy.optimizers_may_share_parameters``).

One optimizer out of several: ``group_indices(k)`` says which concatenated groups are optimizer
``k``'s, and inside ``selecting(k)`` a ``step()`` steps optimizer ``k`` only (the strategy restricts
gradients, unscale, overflow check, clipping and ``zero_grad`` to those groups itself). A plain
PyTorch loop has the same semantics: ``opt.step()`` touches only its parameters.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, MutableMapping, Sequence

import torch


class _MergedState(MutableMapping):
    """The optimizers' ``state`` dicts read as one. A parameter in several optimizers reads as its
    first owner's state by key; ``values()``/``items()`` list every optimizer's states."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def _owner(self, key: Any) -> dict:
        for opt in self._optimizers:
            if key in opt.state:
                return opt.state
        raise KeyError(key)

    def __getitem__(self, key: Any) -> Any:
        return self._owner(key)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError("OptimizerSet.state is read-only: each optimizer keeps its own state")

    def __delitem__(self, key: Any) -> None:
        del self._owner(key)[key]

    def __iter__(self) -> Iterator[Any]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def values(self) -> Iterator[Any]:  # type: ignore[override]
        for opt in self._optimizers:
            yield from opt.state.values()

    def items(self) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        for opt in self._optimizers:
            yield from opt.state.items()

    def clear(self) -> None:
        for opt in self._optimizers:
            opt.state.clear()


class OptimizerSet:
    """Several torch optimizers, seen by a strategy as one (see the module docstring)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        optimizers = list(optimizers)
        if len(optimizers) < 2:
            raise ValueError(f"OptimizerSet of {len(optimizers)} optimizers: give the optimizer itself")
        for k, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizer {k} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        self.optimizers = optimizers
        self._active: list[int] | None = None  # None: every optimizer

    # ------------------------------------------------------------------ torch's optimizer surface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> _MergedState:
        return _MergedState(self.optimizers)

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizers[0].defaults

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step the selected optimizers (all outside ``selecting``); ``kwargs`` go to their ``step``."""
        out = None
        if closure is not None:
            kwargs["closure"] = closure
        for k in self._selected():
            out = self.optimizers[k].step(**kwargs)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for k in self._selected():
            self.optimizers[k].zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout over the concatenated groups: parameter indices numbered across all."""
        state, groups, offset = {}, [], 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: v for i, v in sd["state"].items()})
            for g in sd["param_groups"]:
                groups.append({**g, "params": [offset + i for i in g["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict`: each optimizer takes its groups and its parameters'
        state, renumbered from 0 as torch expects."""
        groups = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(groups)} param groups; this OptimizerSet has "
                             f"{len(self.param_groups)}")
        start = 0
        for opt in self.optimizers:
            mine, start = groups[start:start + len(opt.param_groups)], start + len(opt.param_groups)
            ids = [i for g in mine for i in g["params"]]
            renumber = {old: new for new, old in enumerate(ids)}
            opt.load_state_dict({
                "state": {renumber[i]: v for i, v in state_dict["state"].items() if i in renumber},
                "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in mine]})

    # ------------------------------------------------------------------ one optimizer of several
    def group_indices(self, which: int) -> list[int]:
        """The concatenated param-group indices that belong to optimizer ``which``."""
        if not 0 <= which < len(self.optimizers):
            raise IndexError(f"optimizer which={which}; valid: 0..{len(self.optimizers) - 1}")
        start = sum(len(o.param_groups) for o in self.optimizers[:which])
        return list(range(start, start + len(self.optimizers[which].param_groups)))

    @contextlib.contextmanager
    def selecting(self, which: int | None) -> Iterator[None]:
        """Inside, ``step()``/``zero_grad()`` act on optimizer ``which`` only (None: all)."""
        if which is not None:
            self.group_indices(which)  # validates
        prev, self._active = self._active, None if which is None else [which]
        try:
            yield
        finally:
            self._active = prev

    def _selected(self) -> list[int]:
        return list(range(len(self.optimizers))) if self._active is None else list(self._active)

    def __repr__(self) -> str:
        return f"OptimizerSet({', '.join(type(o).__name__ for o in self.optimizers)})"

    def owners(self) -> dict[int, list[int]]:
        """``id(parameter) -> [optimizer indices holding it]``, in order."""
        out: dict[int, list[int]] = {}
        for k, opt in enumerate(self.optimizers):
            for p in (p for g in opt.param_groups for p in g["params"]):
                if k not in out.setdefault(id(p), []):
                    out[id(p)].append(k)
        return out

    def shared(self) -> list[tuple[torch.Tensor, list[int]]]:
        """Each parameter held by more than one optimizer, with the optimizers holding it."""
        owners, tensors = self.owners(), {id(p): p for g in self.param_groups for p in g["params"]}
        return [(tensors[i], ks) for i, ks in owners.items() if len(ks) > 1]


def suffix(j: int) -> str:
    """How a checkpoint names the state of a parameter's ``j``-th optimizer (in order): ``""`` for
    the first, ``"@j"`` after it (``exp_avg``, ``exp_avg@1``)."""
    return f"@{j}" if j else ""


def param_states(optimizer: Any, p: torch.Tensor) -> list[tuple[str, dict[str, Any]]]:
    """``[(suffix, state)]``: ``p``'s state in each optimizer holding it, in order."""
    if not isinstance(optimizer, OptimizerSet):
        return [("", optimizer.state.get(p, {}))]
    ks = optimizer.owners().get(id(p), [])
    return [(suffix(j), optimizer.optimizers[k].state.get(p, {})) for j, k in enumerate(ks)] or [("", {})]


def state_slots(optimizer: Any) -> dict[int, list[tuple[int, str]]]:
    """``id(parameter) -> [(index in the concatenated param groups' parameters, suffix)]``: where
    each optimizer's state of the parameter goes in ``optimizer.state_dict()`` (the suffixes of
    :func:`param_states`; torch refuses a parameter twice in one optimizer)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        seen = out.setdefault(id(p), [])
        seen.append((i, suffix(len(seen))))
    return out


def split_kind(kind: str) -> tuple[str, str]:
    """A saved state kind ``"exp_avg@1"`` as ``("exp_avg", "@1")``; ``("exp_avg", "")`` unsuffixed."""
    base, at, k = kind.rpartition("@")
    return (base, f"@{k}") if at and k.isdigit() else (kind, "")


def group_indices(optimizer: Any, which: int | None) -> list[int] | None:
    """The param groups of optimizer ``which`` in what a strategy holds (an :class:`OptimizerSet`
    or one optimizer, which is optimizer 0); None for every group."""
    if which is None:
        return None
    if isinstance(optimizer, OptimizerSet):
        return optimizer.group_indices(which)
    if which != 0:
        raise IndexError(f"optimizer which={which}; this strategy holds one optimizer (valid: 0)")
    return list(range(len(optimizer.param_groups)))


def selecting(optimizer: Any, which: int | None) -> contextlib.AbstractContextManager:
    """``optimizer.selecting(which)`` for a set; nothing to select in one optimizer."""
    if isinstance(optimizer, OptimizerSet):
        return optimizer.selecting(which)
    group_indices(optimizer, which)
    return contextlib.nullcontext()


def _refuse_expert_parallel(strategy: Any) -> None:
    if getattr(strategy, "reduces_expert_gradients", False) or getattr(strategy, "module", None) is None:
        return
    for name, p in strategy.module.named_parameters():
        if getattr(p, "allreduce", True) is False and getattr(p, "group_name", "ep_size_1") != "ep_size_1":
            raise ValueError(f"strategy={strategy.name!r}: parameter {name!r} is an expert's of {p.group_name} "
                             "(expert parallelism), which this strategy would average with other experts; "
                             "valid: strategy='ddp', 'zero1' or 'zero2' (or 'zero3'; offload's expert groups "
                             "are not built yet, issue 46) or ep_size=1")


def refuse_shared(strategy: Any, optimizer: Any) -> None:
    """ValueError (one line) for a parameter in several optimizers where ``strategy`` cannot step
    it from each (its ``optimizers_may_share_parameters`` is False), and for expert-parallel
    parameters (moe/, ``ep_size`` > 1) where ``strategy`` does not reduce them over their own group."""
    _refuse_expert_parallel(strategy)
    if getattr(strategy, "optimizers_may_share_parameters", True) or not isinstance(optimizer, OptimizerSet):
        return
    for p, ks in optimizer.shared()[:1]:
        module = getattr(strategy, "module", None)
        names = {id(q): n for n, q in module.named_parameters()} if module is not None else {}
        raise ValueError(f"strategy={strategy.name!r}: parameter {names.get(id(p), tuple(p.shape))!r} is in "
                         f"optimizers {' and '.join(map(str, ks))}, but this strategy partitions each parameter's "
                         "optimizer state once; valid: give each parameter to one optimizer, or a replicated "
                         "strategy (single, ddp)")


def accepted(step: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without a ``closure`` that ``step`` does not take (an optimizer written as
    ``step(self)``: the caller then runs the closure itself); other keywords are passed as given."""
    if "closure" not in kwargs:
        return kwargs
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return kwargs
    takes = "closure" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return kwargs if takes else {k: v for k, v in kwargs.items() if k != "closure"}
