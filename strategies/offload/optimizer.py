"""The offloaded optimizer step: fp32 master weights and Adam state in host RAM or on NVMe,
updated sub-group by sub-group with the fused one-pass kernel
(:func:`zerotrain.ops.fused_adam_step`), which also writes the bf16/fp16 working copy.

The user's optimizer object stays authoritative for hyperparameters: every step reads ``lr``,
``betas``, ``eps``, ``weight_decay`` (and AdamW-ness) from its ``param_groups``, so an LR scheduler
holding it keeps working. Its ``"params"`` were re-targeted by the ZeRO stage onto fp32 master
*slots* (:class:`~zerotrain.strategies.zero.sharded_optimizer.ShardedOptimizer`: ZeRO-2 one per
group, ZeRO-3 one per run of a unit), and in RAM its ``state`` holds the Adam state per slot in
torch's own layout. The step does not call ``optimizer.step()``, so step hooks registered on the
optimizer do not run.

Which optimizers take the fused path (:func:`fused_path_refusal`): ``torch.optim.Adam`` and
``AdamW`` (``fused``/``foreach`` flags are irrelevant here) and :class:`zerotrain.ops.CPUAdam` with
fp32 state, without ``amsgrad``, ``maximize`` or ``differentiable``. Any other optimizer:

* ``optimizer_device="cpu"``: :class:`TorchOffload` runs the user's own ``optimizer.step()`` on the
  host fp32 master slices (the whole partition at once), then copies the result into the working
  parameters; element-wise optimizers only, as for ZeRO itself.
* ``optimizer_device="nvme"``: refused at set-up with the reason. Swapping an arbitrary optimizer's
  state would need its state layout; Adam's is known.

For checkpoints the stepper speaks ZeRO's layout (``state_dict()`` is ``{"master": [...],
"optimizer": optimizer.state_dict()}`` with torch's ``step``/``exp_avg``/``exp_avg_sq`` per slot,
``load_state_dict`` takes the same): the stage's ``param_shards`` / ``load_param_shards`` read and
fill it as they do a :class:`ShardedOptimizer`, so the Trainer's per-parameter format sees the real
state and checkpoints move between ``zero2``/``zero3`` and ``offload``. With NVMe the tensors are
memory-mapped copies of the swap files (see :meth:`~.swapper.SwappedStates.snapshot`). With
``optimizer_state_dtype="bf16"`` the swapped moments are bf16 (the kernel rounds them
stochastically); the checkpoint still holds them as fp32, and loading rounds them back the same way.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import torch

from ...ops import CPUAdam, fused_adam_step
from ...ops.deepspeed_adam import DeepSpeedBetaPowers
from ..zero.sharded_optimizer import ShardedOptimizer
from .grad_swap import SwappedGrads
from .plan import SubGroup, run_pipelined
from .swapper import RamStates, SwappedStates


def fused_path_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be stepped by the fused Adam kernel, or None if it can."""
    name = type(optimizer).__name__
    if isinstance(optimizer, CPUAdam):
        if optimizer.state_dtype != torch.float32:
            return (f"CPUAdam with state_dtype={optimizer.state_dtype} (offload keeps fp32 state; for bf16 "
                    f"moments on disk set the strategy's optimizer_state_dtype='bf16')")
        return None
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        return f"{name} is not Adam, AdamW or zerotrain.ops.CPUAdam"
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                return f"{name} param group {i} sets {key}=True, which the fused kernel does not do"
    return None


def adam_hyper(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """The kernel's keyword arguments, read from one param group now."""
    beta1, beta2 = group["betas"]
    if isinstance(optimizer, CPUAdam):
        adamw, bias_correction = bool(group["adamw_mode"]), bool(group["bias_correction"])
    else:
        adamw = bool(group.get("decoupled_weight_decay", False)) or isinstance(optimizer, torch.optim.AdamW)
        bias_correction = True
    # DeepSpeed's faces (DeepSpeedCPUAdam, the config's Adam/AdamW) ask for its kernel's operation order
    order = getattr(optimizer, "kernel_order", "torch")
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw=adamw, bias_correction=bias_correction,
                order=order)


class _GatherMasters:
    """``gather_full`` as ZeRO-2's ``full_state_dict`` calls it, fed by ``full_master``."""

    transfer: Any

    def full_master(self, slot: int) -> torch.Tensor:
        raise NotImplementedError

    def gather_full(self, index: int, layout: Any, rank: int, queue: Any, group: object = None,
                    dst: int = 0) -> torch.Tensor | None:
        """Collective: the complete fp32 flat buffer of group ``index`` on ``dst``, None elsewhere
        (:meth:`ShardedOptimizer.gather_full` on this rank's master, moved to the working device
        for the collective)."""
        master = self.full_master(index).to(self.transfer.device)
        return ShardedOptimizer.gather_full(SimpleNamespace(masters={index: master}), index, layout,
                                            rank, queue, group, dst)


class OffloadedAdam(_GatherMasters):
    """Adam/AdamW over sub-groups of the slots; state in RAM (the optimizer's own ``state``) or in
    swap files (``swapped``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, subgroups: Sequence[SubGroup], transfer: Any,
                 swapped: SwappedStates | None = None, swapped_grads: SwappedGrads | None = None) -> None:
        """The optimizer's params must already be the slots: fp32 host tensors, group by group.
        With ``swapped`` and no external master, the masters are written to its files and the
        optimizer's params are replaced by meta tensors, so no RAM copy remains. With
        ``swapped_grads`` each sub-group's gradient comes in with its state (``grad_swap.py``)."""
        self.optimizer, self.subgroups, self.transfer = optimizer, list(subgroups), transfer
        self.swapped_grads = swapped_grads
        self.masters = [m for g in optimizer.param_groups for m in g["params"]]
        self.slot_group = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self.numels = [m.numel() for m in self.masters]
        self.steps = [0] * len(self.masters)  # swapped state only; in RAM: state["step"]
        if swapped is None:
            self.states: RamStates | SwappedStates = RamStates(self.subgroups, self.masters, optimizer)
            for i in range(len(self.masters)):
                self.states.slot_state(i)  # allocate now: the memory is visible from set-up
        else:
            swapped.fill({"master": [m.detach() for m in self.masters]} if swapped.external is None else {})
            if swapped.external is None:
                self.masters = [torch.empty(n, device="meta") for n in self.numels]
                it = iter(self.masters)
                for group in optimizer.param_groups:
                    group["params"] = [next(it) for _ in group["params"]]
            self.states = swapped
        #: with file-backed masters (ZeRO-3 ``param_device="nvme"``): ``prefetch(k)``/``release(k)``
        self.pager: Any = None
        #: DeepSpeed's order (``kernel_order``): the fp32 ``beta^step`` pair of this optimizer, as
        #: ``DeepSpeedCPUAdam``'s host object keeps it: a running product from step 1, recomputed by
        #: ``pow`` when the step jumps (the first step after a checkpoint load)
        self.beta_powers = DeepSpeedBetaPowers(tuple(optimizer.defaults.get("betas", (0.0, 0.0))))

    @property
    def swapped(self) -> bool:
        return isinstance(self.states, SwappedStates)

    def _step_of(self, slot: int) -> int:
        return self.steps[slot] if self.swapped else int(self.states.slot_state(slot)["step"])

    # ------------------------------------------------------------------ the step
    def step(self, grad_scale: float = 1.0) -> None:
        """One optimizer step on every sub-group. ``grad_scale`` multiplies the host gradients
        inside the kernel (the strategy folds the clip coefficient and any loss scale they still
        carry into it)."""
        self.transfer.grads_ready()
        if self.swapped_grads is not None:
            self.swapped_grads.flush()  # each sub-group's read brings its gradient: written first
        hypers = [adam_hyper(self.optimizer, g) for g in self.optimizer.param_groups]
        steps = [self._step_of(i) + 1 for i in range(len(self.masters))]
        tails = getattr(self.optimizer, "kernel_tail", None)  # slot -> DeepSpeed's scalar-tail ranges

        def step_one(k: int, b: int) -> None:
            sg = self.subgroups[k]
            if self.pager is not None:
                self.pager.prefetch(k + 1)
            master, exp_avg, exp_avg_sq = self.states.views(k, b)
            grad = self.transfer.grad(sg) if self.swapped_grads is None else self.swapped_grads.view(k, b)
            hyper = hypers[self.slot_group[sg.slot]]
            ds = {}
            if hyper["order"] == "deepspeed":
                ds["beta_powers"] = self.beta_powers.advance(steps[sg.slot], hyper["beta1"], hyper["beta2"])
                if tails is not None:
                    ds["tail"] = [(max(lo, sg.lo) - sg.lo, min(hi, sg.hi) - sg.lo)
                                  for lo, hi in tails.get(sg.slot, []) if lo < sg.hi and hi > sg.lo]
            fused_adam_step(master, grad, exp_avg, exp_avg_sq, step=steps[sg.slot],
                            grad_scale=grad_scale, param_out=self.transfer.param_out(sg, master),
                            **self._rounding(k, exp_avg), **hyper, **ds)
            self.transfer.after_step(sg, master)
            if self.pager is not None:
                self.pager.stepped(k)

        if self.pager is not None:
            self.pager.prefetch(0)
        try:
            run_pipelined(len(self.subgroups), self.states.buffer_count, self.states.read, step_one,
                          self.states.write)
        except BaseException:
            if self.pager is not None:
                with contextlib.suppress(Exception):  # the step's own error is the one to report
                    self.pager.finish()
            raise
        if self.pager is not None:
            self.pager.finish()
        self.transfer.finish()
        # what torch's LR schedulers look for to know the optimizer stepped (this *is* its step;
        # its step hooks do not run)
        self.optimizer._opt_called = True
        if self.swapped:
            self.steps = steps
        else:
            for i, n in enumerate(steps):
                self.states.slot_state(i)["step"].fill_(float(n))

    def _rounding(self, k: int, exp_avg: torch.Tensor) -> dict[str, Any]:
        """bf16 moments (swapped with ``optimizer_state_dtype="bf16"``) are rounded stochastically,
        so updates smaller than a bf16 step still move them on average."""
        if exp_avg.dtype != torch.bfloat16 or self.masters[0].dtype != torch.float32:
            return {}  # 16-bit masters (``master_dtype``): moments rounded to nearest, as DeepSpeed's
        return {"stochastic_rounding": True, "seed": self.states.rounding_seed(k)}

    # ------------------------------------------------------------------ what it holds
    def state_tensors(self) -> list[torch.Tensor]:
        if self.swapped:
            return self.states.staging()
        return [t for st in self.optimizer.state.values() for k, t in st.items() if k != "step"]

    def master_tensors(self) -> list[torch.Tensor]:
        return [m for m in self.masters if m.device.type != "meta"]

    def full_master(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s fp32 master in host RAM (read back from disk if swapped)."""
        if self.swapped:
            return self.states.gather_kind("master", slot, self.numels[slot])
        return self.masters[slot].detach()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"master": [per slot], "optimizer": optimizer.state_dict()}`` (ZeRO's layout); swapped
        tensors are memory-mapped copies of the swap files (see ``SwappedStates.snapshot``)."""
        if not self.swapped:
            return {"master": [m.detach().clone() for m in self.masters],
                    "optimizer": self.optimizer.state_dict()}
        snap = self.states.snapshot(self.numels, after=self.pager.release if self.pager is not None else None)
        saved = self.optimizer.state_dict()  # param_groups; the swapped state is not in it
        saved["state"] = {i: {"step": torch.tensor(float(self.steps[i])), "exp_avg": snap["exp_avg"][i],
                              "exp_avg_sq": snap["exp_avg_sq"][i]} for i in range(len(self.numels))}
        return {"master": snap["master"], "optimizer": saved}

    @contextlib.contextmanager
    def exposed_state(self) -> Iterator[None]:
        """For code that reads ``optimizer.state`` directly (ZeRO-3's checkpoints): with swapped
        state, fill it with memory-mapped snapshot tensors for the duration."""
        if not self.swapped:
            yield
            return
        saved = self.state_dict()["optimizer"]["state"]
        for i, m in enumerate(self.masters):
            self.optimizer.state[m] = saved[i]
        try:
            yield
        finally:
            self.optimizer.state.clear()

    def import_loaded_state(self) -> None:
        """After a load that went through ``optimizer.load_state_dict`` (ZeRO-3's): move the state
        it put in RAM into the swap files. The masters are external then (the stage loaded them)."""
        if not self.swapped or not self.optimizer.state:
            return
        state = self.optimizer.state
        values: dict[str, list[torch.Tensor]] = {"exp_avg": [], "exp_avg_sq": []}
        for i, (m, n) in enumerate(zip(self.masters, self.numels)):
            st = state.get(m, {})
            for kind in values:
                values[kind].append(st[kind].reshape(-1).float() if kind in st else torch.zeros(n))
            self.steps[i] = int(st["step"]) if "step" in st else 0
        state.clear()
        self.states.fill(values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters, opt_state = state["master"], state["optimizer"]
        if len(masters) != len(self.numels):
            raise ValueError(f"checkpoint has {len(masters)} master slices, this run has {len(self.numels)}")
        for i, (m, n) in enumerate(zip(masters, self.numels)):
            if m.numel() != n:
                raise ValueError(f"checkpoint master slice {i} has {m.numel()} elements, this run needs "
                                 f"{n}: was it written with another world size?")
        if not self.swapped:
            for m, s in zip(self.masters, masters):
                m.detach().copy_(s)
            self.optimizer.load_state_dict(opt_state)  # new state tensors, on the masters' device
        else:
            _load_param_groups(self.optimizer, opt_state["param_groups"])
            saved = opt_state.get("state", {})
            values = {"master": [s.float() for s in masters], "exp_avg": [], "exp_avg_sq": []}
            for i, n in enumerate(self.numels):
                for kind in ("exp_avg", "exp_avg_sq"):
                    values[kind].append(saved[i][kind].float() if kind in saved.get(i, {}) else torch.zeros(n))
                self.steps[i] = int(saved[i]["step"]) if "step" in saved.get(i, {}) else 0
            self.states.fill(values)
        for i, s in enumerate(masters):
            self.transfer.load_working(i, s.float())

    def close(self) -> None:
        self.states.close()


def _load_param_groups(optimizer: torch.optim.Optimizer, saved: Sequence[dict[str, Any]]) -> None:
    """Restore hyperparameters (everything but ``params``) like ``Optimizer.load_state_dict``."""
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint has {len(saved)} optimizer param groups, this run has "
                         f"{len(optimizer.param_groups)}")
    for group, s in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in s.items() if k != "params"})


class TorchOffload(_GatherMasters):
    """Any other element-wise optimizer, stepped by itself on the host fp32 master slices."""

    swapped = False

    def __init__(self, sharded: ShardedOptimizer, transfer: Any, subgroups: Sequence[SubGroup]) -> None:
        self.sharded, self.transfer, self.subgroups = sharded, transfer, list(subgroups)
        self.optimizer, self.masters = sharded.optimizer, sharded.masters

    def step(self, grad_scale: float = 1.0) -> None:
        """The optimizer's own step on the host masters, the gradients multiplied by
        ``grad_scale`` first (as :meth:`OffloadedAdam.step`)."""
        self.transfer.grads_ready()
        grads = [self.transfer.slot_grad(i).float() for i in range(len(self.masters))]
        if grad_scale != 1.0:
            for g in grads:
                g.mul_(grad_scale)
        self.sharded.set_grads(grads)
        self.sharded.step()
        self.sharded.clear_grads()
        for sg in self.subgroups:
            master = self.masters[sg.slot][sg.lo:sg.hi]
            out = self.transfer.param_out(sg, master)
            if out is not None:
                out.copy_(master)
            self.transfer.after_step(sg, master)
        self.transfer.finish()

    def state_tensors(self) -> list[torch.Tensor]:
        return self.sharded.state_tensors()

    def master_tensors(self) -> list[torch.Tensor]:
        return list(self.masters)

    def full_master(self, slot: int) -> torch.Tensor:
        return self.masters[slot].detach()

    @contextlib.contextmanager
    def exposed_state(self) -> Iterator[None]:
        yield

    def import_loaded_state(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return self.sharded.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sharded.load_state_dict(state)
        for i, m in enumerate(self.masters):
            self.transfer.load_working(i, m.detach())

    def close(self) -> None:
        pass
