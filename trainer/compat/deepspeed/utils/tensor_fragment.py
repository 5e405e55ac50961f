"""``deepspeed.utils``' parameter, gradient and optimizer-state accessors (``safe_get_full_fp32_param``
and its siblings) over a zerotrain strategy.

Under ZeRO each rank holds a *fragment* of a parameter: elements ``[start, start + count)`` of its
flattened fp32 master, of each optimizer state tensor and of its reduced gradient. The strategies of
ZeRO 1, 2 and 3 say where with ``master_pieces()`` (per master slot: ``(parameter, first element
in the parameter, first element in the slot, count)``); slot ``k`` is ``sharded.masters[k]``, its
optimizer state ``optimizer.state[sharded.masters[k]]`` and its reduced gradient
``grads.partitions()[k]``. The *full* accessors are collective over the partitioning group (every
rank calls them, for the same parameter, in the same order): each rank writes its fragment into a
zero buffer of the parameter's size and an all-reduce sums them, as DeepSpeed does. The *set*
accessors are local: each rank writes the part of the given full value that its fragment covers.

What each returns, as in DeepSpeed 0.19.8:

* ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: the fp32 master / state in the
  parameter's shape (fp32); None at ZeRO stage 0 (DeepSpeed's stage 0 keeps no separate master),
  for a frozen parameter, and for a tensor no engine trains. A state key the optimizer does not
  hold (Adam before its first step, or an unknown key): ValueError on every rank.
* ``safe_get_full_grad``: at stage 0 the parameter's ``.grad`` (the averaged gradient after the
  boundary's backward; None after ``step()``); under ZeRO the averaged gradient (fp32) between the
  boundary's backward and ``step()`` (ZeRO-1 before the boundary or inside ``no_sync``: the
  ``.grad`` this rank accumulated, as DeepSpeed's ZeRO-1 answers then); outside that window a
  ValueError (DeepSpeed's message) on every rank. DeepSpeed's ZeRO-3 differs there: it returns the
  gradient the last step applied (zerotrain's step zeroes the partitions, so there is nothing to
  return but zeros).
* ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` / ``safe_set_full_grad``: write
  the master / state / reduced gradient; the next ``step()`` reads them (the working 16-bit or
  partitioned parameter follows at that step, as in DeepSpeed; with fp32 at ZeRO 1/2 the working
  parameter *is* the master, so it changes at once).
* ``safe_*_local_*``: ZeRO-3 only (AssertionError elsewhere, as DeepSpeed): this rank's fragment,
  1-D fp32. zerotrain cuts each *unit*'s flat buffer into equal partitions where DeepSpeed cuts each
  parameter, so the fragment's size differs from DeepSpeed's ``ds_tensor`` (and may be empty); a
  value given to ``safe_set_local_*`` must have the size ``safe_get_local_*`` returned.

Not built (NotImplementedError): writing optimizer state swapped to NVMe (``offload_optimizer.device:
nvme``; reading it works), expert-parallel parameters (moe/ with ``ep_size`` > 1). The pipeline
engine's parameters answer as a tensor no engine trains (None).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

#: DeepSpeedEngines built by ``initialize`` (the engine registers itself)
_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
#: per engine: id(parameter) -> [(slot, first element in the parameter, first element in the slot, count)]
_pieces: "weakref.WeakKeyDictionary[Any, dict[int, list[tuple[int, int, int, int]]]]" = weakref.WeakKeyDictionary()

_GRAD_WINDOW = "Gradients are only available immediately after backward and before engine step"


def register(engine: Any) -> None:
    _engines.add(engine)


def _engine_of(param: torch.Tensor) -> Any:
    """The DeepSpeedEngine whose module holds ``param`` (None: no engine trains it)."""
    for engine in list(_engines):
        if any(q is param for q in engine.module.parameters()):
            return engine
    return None


def _partitioned(param: torch.Tensor) -> tuple[Any, Any] | None:
    """``(engine, strategy)`` when a ZeRO strategy partitions ``param`` and trains it; None when no
    engine trains it, it is frozen, or the strategy keeps parameters whole (stage 0)."""
    engine = _engine_of(param)
    if engine is None or not param.requires_grad:
        return None
    s = engine.zerotrain_engine.strategy
    if not hasattr(s, "master_pieces"):
        return None
    if getattr(s, "holds_experts", False) or any(getattr(u, "has_own_group", False) for u in getattr(s, "units", ())):
        raise NotImplementedError("deepspeed.utils tensor-fragment accessors: a model with expert-parallel "
                                  "parameters (moe/, ep_size > 1) is not built; valid: ep_size=1")
    return engine, s


def _pieces_of(engine: Any, s: Any, param: torch.Tensor) -> list[tuple[int, int, int, int]]:
    table = _pieces.get(engine)
    if table is None:
        table = {}
        for k, pieces in enumerate(s.master_pieces()[1]):
            for p, p_start, s_start, count in pieces:
                table.setdefault(id(p), []).append((k, p_start, s_start, count))
        _pieces[engine] = table
    return table.get(id(param), [])


def _state_slot(s: Any, k: int, key: str) -> torch.Tensor:
    """Optimizer state ``key`` of master slot ``k``, flattened (a live view of the state)."""
    state = s.optimizer.state.get(s.sharded.masters[k], {})
    value = state.get(key)
    if not torch.is_tensor(value) or value.numel() != s.sharded.masters[k].numel():
        raise ValueError(f"{key} not found in optimizer state fragment")
    return value.view(-1)


def _refuse_swapped(s: Any, what: str) -> None:
    if getattr(s.sharded, "swapped", False):
        raise NotImplementedError(f"deepspeed.utils.{what}: optimizer state swapped to NVMe (offload_optimizer "
                                  "device nvme) is not built; valid: device cpu or none")


def _grad_slots(engine: Any, s: Any) -> list[torch.Tensor]:
    """This rank's reduced gradient slice of each master slot, valid between the boundary's
    backward and ``step()``; refused outside that window (DeepSpeed's ZeRO-1/2 refuse too; its
    ZeRO-3 returns the gradient the last step applied, which zerotrain's step has zeroed)."""
    if not engine._fresh_grads:
        raise ValueError(_GRAD_WINDOW + (" (zerotrain's ZeRO-3 zeroes them in step(); DeepSpeed's keeps the last "
                                          "step's until the next backward: read them before step())"
                                          if s.stage == 3 else ""))
    slots = s.grads.partitions()
    if any(t.device.type == "meta" for t in slots):
        raise NotImplementedError("deepspeed.utils: gradients swapped to NVMe (grad_device nvme) are not built; "
                                  "valid: gradients in memory")
    return slots


def _gather(engine: Any, s: Any, param: torch.Tensor, read: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Collective over the partitioning group: the full fp32 tensor whose fragments ``read(slot)``
    gives (a flat tensor per master slot), in ``param``'s shape. Every rank checks its fragments
    before the all-reduce and all agree on a refusal, so none waits alone."""
    buf = torch.zeros(param.numel(), dtype=torch.float32, device=engine.device)
    error = None
    try:
        for k, p_start, s_start, count in _pieces_of(engine, s, param):
            buf[p_start:p_start + count].copy_(read(k)[s_start:s_start + count])
    except ValueError as exc:
        error = exc
    if dist.is_initialized():
        flag = torch.tensor([1.0 if error is not None else 0.0], device=engine.device)
        dist.all_reduce(flag, group=s.group)
        if flag.item() > 0:
            raise error if error is not None else ValueError(_peer_error(read))
        dist.all_reduce(buf, group=s.group)
    elif error is not None:
        raise error
    return buf.view(param.shape)


def _peer_error(read: Callable[[int], torch.Tensor]) -> str:
    """The refusal a rank without a fragment of the parameter reports when another refused."""
    return getattr(read, "refusal", "another rank refused (see its error)")


def _scatter(engine: Any, s: Any, param: torch.Tensor, value: torch.Tensor, target: Callable[[int], torch.Tensor]) -> None:
    """Local: this rank's fragments of the full ``value`` into ``target(slot)`` (a flat live tensor)."""
    if value.numel() != param.numel():
        raise ValueError(f"value has {value.numel()} elements, the parameter {param.numel()} ({tuple(param.shape)})")
    flat = value.detach().reshape(-1)
    with torch.no_grad():
        for k, p_start, s_start, count in _pieces_of(engine, s, param):
            target(k)[s_start:s_start + count].copy_(flat[p_start:p_start + count])


def _reader(s: Any, key: str | None) -> Callable[[int], torch.Tensor]:
    def read(k: int) -> torch.Tensor:
        return s.sharded.masters[k].detach().view(-1) if key is None else _state_slot(s, k, key)

    read.refusal = f"{key} not found in optimizer state fragment"  # type: ignore[attr-defined]
    return read


# ---------------------------------------------------------------------------- full
def _get_full(param: torch.Tensor, key: str | None) -> torch.Tensor | None:
    found = _partitioned(param)
    if found is None:
        return None
    engine, s = found
    with s.stepper.exposed_state(s.sharded):
        return _gather(engine, s, param, _reader(s, key))


def _set_full(param: torch.Tensor, value: torch.Tensor, key: str | None, what: str) -> None:
    found = _partitioned(param)
    if found is not None:
        _refuse_swapped(found[1], what)
        _scatter(*found, param, value, _reader(found[1], key))


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """Collective: the parameter's fp32 master, whole (None: stage 0, frozen, not trained here)."""
    return _get_full(param, None)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """Collective: optimizer state ``optim_state_key`` (``"exp_avg"``, ...) of the parameter, whole."""
    return _get_full(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Local: write this rank's part of ``value`` (the whole parameter) into its fp32 master."""
    _set_full(param, value, None, "safe_set_full_fp32_param")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """Local: write this rank's part of ``value`` into optimizer state ``optim_state_key``."""
    _set_full(param, value, optim_state_key, "safe_set_full_optimizer_state")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Under ZeRO (collective): the averaged gradient, fp32; else the parameter's ``.grad``.
    (ZeRO-1 may keep a ``.grad`` whose elements outside this rank's partition are not averaged:
    DeepSpeed's has none, so the partitions are read.)"""
    found = _partitioned(param)
    if found is None:
        return param.grad
    engine, s = found
    if engine._local_grads and param.grad is not None:
        return param.grad  # ZeRO-1 before the boundary or inside no_sync: this rank's accumulation, as DeepSpeed's
    slots = _grad_slots(engine, s)
    return _gather(engine, s, param, lambda k: slots[k].view(-1))


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Local: write this rank's part of ``value`` into the gradient the next ``step()`` reads
    (``param.grad`` itself without ZeRO)."""
    found = _partitioned(param)
    if found is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    engine, s = found
    slots = _grad_slots(engine, s)
    _scatter(engine, s, param, value, lambda k: slots[k].view(-1))


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """Collective: each parameter's gradient becomes ``update_func(full gradient, parameter)``."""
    for p in param_list:
        if _partitioned(p) is not None:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))
        elif p.grad is not None:
            p.grad.copy_(update_func(p.grad, p))


# ---------------------------------------------------------------------------- local (ZeRO-3)
_LOCAL_ONLY = "This API is only defined for ZeRO-3 partitioned parameters"


def _local(param: torch.Tensor) -> tuple[Any, Any] | None:
    """``(engine, strategy)`` for a ZeRO-3 parameter; None for a frozen one; AssertionError for a
    parameter ZeRO-3 does not partition (DeepSpeed's refusal)."""
    engine = _engine_of(param)
    s = engine.zerotrain_engine.strategy if engine is not None else None
    assert s is not None and getattr(s, "stage", 0) == 3 and hasattr(s, "master_pieces"), _LOCAL_ONLY
    return _partitioned(param)


def _local_get(param: torch.Tensor, read: Callable[[int], torch.Tensor]) -> torch.Tensor:
    engine, s = _local(param) or (None, None)
    parts = [read(k)[s_start:s_start + count].float() for k, _, s_start, count in _pieces_of(engine, s, param)]
    return torch.cat(parts).to(engine.device) if parts else torch.zeros(0, device=engine.device)


def _local_set(param: torch.Tensor, value: torch.Tensor, target: Callable[[int], torch.Tensor]) -> None:
    engine, s = _local(param) or (None, None)
    pieces = _pieces_of(engine, s, param)
    flat = value.detach().reshape(-1)
    if flat.numel() != sum(p[3] for p in pieces):
        raise AssertionError(f" Number of elements do not match: {flat.numel()} != {sum(p[3] for p in pieces)} "
                             "(this rank's fragment: the size safe_get_local_* returns)")
    at = 0
    with torch.no_grad():
        for k, _, s_start, count in pieces:
            target(k)[s_start:s_start + count].copy_(flat[at:at + count])
            at += count


def _get_local(param: torch.Tensor, key: str | None) -> torch.Tensor | None:
    found = _local(param)
    if found is None:
        return None
    s = found[1]
    with s.stepper.exposed_state(s.sharded):
        return _local_get(param, _reader(s, key))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return _get_local(param, None)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return _get_local(param, optim_state_key)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    found = _local(param)
    if found is None:
        return None
    slots = _grad_slots(*found)
    return _local_get(param, lambda k: slots[k].view(-1))


def _set_local(param: torch.Tensor, value: torch.Tensor, key: str | None, what: str) -> None:
    found = _local(param)
    if found is not None:
        _refuse_swapped(found[1], what)
        _local_set(param, value, _reader(found[1], key))


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    _set_local(param, value, None, "safe_set_local_fp32_param")


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set_local(param, value, optim_state_key, "safe_set_local_optimizer_state")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    found = _local(param)
    if found is not None:
        slots = _grad_slots(*found)
        _local_set(param, value, lambda k: slots[k].view(-1))


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
